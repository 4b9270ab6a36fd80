"""Settings precedence and errors, and the inferctl command line."""

from __future__ import annotations

import json
import os

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from inferflux.gateway import cli
from inferflux.gateway.settings import DEFAULT_MODEL_NAME, ConfigError, ensure_data_dir, load_settings

INFERCTL = [sys.executable, "-m", "inferflux.gateway.cli"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inferflux.yaml"
    path.write_text(text)
    return path


def test_defaults(tmp_path: Path) -> None:
    settings = load_settings(env={"XDG_DATA_HOME": str(tmp_path)})
    assert (settings.host, settings.port, settings.backend) == ("127.0.0.1", 8080, "auto")
    assert settings.max_body_bytes == 4 * 1024 * 1024
    [(spec, backend)] = settings.model_specs()
    assert spec.name == DEFAULT_MODEL_NAME and backend == "auto"  # the registry's chain: cpu on this machine
    assert Path(spec.path).is_file()


def test_default_data_dir_follows_xdg(tmp_path: Path) -> None:
    assert load_settings(env={"XDG_DATA_HOME": str(tmp_path)}).data_dir == tmp_path / "inferflux"
    assert load_settings(env={}).data_dir == Path.home() / ".local" / "share" / "inferflux"


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "host: 0.0.0.0\nport: 9000\nlog_level: debug\nbackend: cuda\nengine:\n  kv_cache_bytes: 1GiB\n",
    )
    from_file = load_settings(config, env={})
    assert (from_file.host, from_file.port, from_file.log_level) == ("0.0.0.0", 9000, "debug")
    assert from_file.engine.kv_cache_bytes == 1024**3

    env = {"INFERFLUX_PORT": "9100", "INFERFLUX_BACKEND": "cpu", "INFERFLUX_KV_CACHE_BYTES": "64MiB"}
    from_env = load_settings(config, env=env)
    assert (from_env.host, from_env.port, from_env.backend) == ("0.0.0.0", 9100, "cpu")
    assert from_env.engine.kv_cache_bytes == 64 * 1024**2

    flags = {"port": 9200, "host": None, "engine.kv_cache_bytes": "32MiB"}
    from_flags = load_settings(config, env=env, overrides=flags)
    assert (from_flags.host, from_flags.port) == ("0.0.0.0", 9200)
    assert from_flags.engine.kv_cache_bytes == 32 * 1024**2


def test_the_websocket_section_from_the_file_the_environment_and_the_flag(tmp_path: Path) -> None:
    from inferflux.gateway.slowclients import server_options

    defaults = load_settings(env={}).websocket
    assert (defaults.enabled, defaults.max_in_flight, defaults.max_message_bytes) == (True, 8, 4 * 1024**2)
    config = write(tmp_path, "websocket:\n  max_in_flight: 2\n  max_message_bytes: 64KiB\n  ping_interval_seconds: 5\n")
    from_file = load_settings(config, env={})
    assert (from_file.websocket.enabled, from_file.websocket.max_in_flight) == (True, 2)
    options = server_options(from_file.input_limits, None, from_file.websocket)
    assert (options["ws_ping_interval"], options["ws_ping_timeout"], options["ws_max_size"]) == (5, 5, 128 * 1024)
    assert not load_settings(config, env={"INFERFLUX_WEBSOCKET": "false"}).websocket.enabled
    args = cli.build_parser().parse_args(["serve", "--no-websocket"])
    assert not load_settings(config, env={}, overrides={"websocket.enabled": args.websocket}).websocket.enabled
    assert cli.build_parser().parse_args(["serve"]).websocket is None  # unset: the file's or the environment's
    with pytest.raises(ConfigError, match="max_in_flight"):
        load_settings(write(tmp_path, "websocket:\n  max_in_flight: 0\n"), env={})


def test_config_file_from_env_and_models(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "dtype: bfloat16\nmodels:\n"
        "  - {name: a, path: /models/a.gguf, aliases: [alpha]}\n"
        "  - {name: b, path: /models/b, backend: mlx, dtype: float32}\n",
    )
    settings = load_settings(env={"INFERFLUX_CONFIG": str(config), "INFERFLUX_DTYPE": "float32"})
    (a, a_backend), (b, b_backend) = settings.model_specs()
    assert (a.name, a.aliases, a.dtype, a_backend) == ("a", ("alpha",), "float32", "auto")
    assert (b.name, b.dtype, b_backend) == ("b", "float32", "mlx")

    single = load_settings(config, env={"INFERFLUX_MODEL": "/models/Other-Model.gguf"})
    [(spec, _)] = single.model_specs()
    assert (spec.name, spec.path) == ("other-model", "/models/Other-Model.gguf")
    named = load_settings(config, env={}, overrides={"model": "/m.gguf", "model_name": "mine"})
    assert named.model_specs()[0][0].name == "mine"


def test_speculative_decoding_per_model_or_engine_wide(tmp_path: Path) -> None:
    from inferflux.gateway.models.served import engine_config_from

    config = write(
        tmp_path,
        "engine:\n  speculative: {k: 3}\nmodels:\n"
        "  - {name: a, path: /models/a.gguf, speculative: {k: 6, max_batch: 2}}\n"
        "  - {name: b, path: /models/b.gguf}\n",
    )
    settings = load_settings(config, env={})
    a = engine_config_from(settings.engine, settings.model_speculative("a")).speculative
    b = engine_config_from(settings.engine, settings.model_speculative("b")).speculative
    assert (a.method, a.k, a.max_batch) == ("ngram", 6, 2)  # the model's own section wins
    assert (b.k, b.max_batch) == (3, 8)  # the engine-wide one, with its defaults
    assert engine_config_from(load_settings(env={}).engine).speculative is None  # off unless configured


def test_engine_passes_go_to_the_model_specs_not_the_engine_config(tmp_path: Path) -> None:
    from inferflux.gateway.models.served import engine_config_from

    # engine.passes made serve fail (EngineConfig has no passes): it reaches the backend via ModelSpec.
    settings = load_settings(write(tmp_path, "engine:\n  passes: {quantise: hybrid}\n"), env={})
    engine_config_from(settings.engine)
    assert settings.model_specs()[0][0].passes == {"quantise": "hybrid"}


def test_a_draft_model_is_speculative_configuration(tmp_path: Path) -> None:
    from inferflux.gateway.models.served import engine_config_from

    config = write(
        tmp_path,
        "models:\n"
        "  - {name: a, path: /m/a.gguf, speculative: {method: draft, draft_layers: 8, k: 3}}\n"
        "  - {name: b, path: /m/b.gguf, speculative: {method: draft, draft_model: ~/small.gguf}}\n",
    )
    settings = load_settings(config, env={})
    a = engine_config_from(settings.engine, settings.model_speculative("a")).speculative
    b = engine_config_from(settings.engine, settings.model_speculative("b")).speculative
    assert (a.method, a.draft_layers, a.draft_model, a.k) == ("draft", 8, None, 3)
    assert (b.draft_layers, b.draft_model) == (None, os.path.expanduser("~/small.gguf"))


def test_preemption_by_swap_is_engine_configuration(tmp_path: Path) -> None:
    from inferflux.gateway.models.served import engine_config_from

    config = write(tmp_path, "engine:\n  preemption_mode: swap\n  swap_space_bytes: 64MiB\n  swap_dir: ~/kv-swap\n")
    engine = engine_config_from(load_settings(config, env={}).engine)
    assert (engine.preemption_mode, engine.swap_space_bytes) == ("swap", 64 << 20)
    assert engine.swap_dir == os.path.expanduser("~/kv-swap") != "~/kv-swap"
    default = engine_config_from(load_settings(env={}).engine)
    assert (default.preemption_mode, default.swap_dir) == ("recompute", None)


def test_the_cpu_kernels_level_from_the_file_or_the_environment(tmp_path: Path) -> None:
    assert load_settings(env={}).runtime.cpu_isa is None  # unset: the kernels read INFERFLUX_CPU_ISA, then auto
    config = write(tmp_path, "runtime:\n  cpu_isa: AVX2\n")
    assert load_settings(config, env={}).runtime.cpu_isa == "avx2"
    assert load_settings(config, env={"INFERFLUX_CPU_ISA": "native"}).runtime.cpu_isa == "auto"


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("port: 70000\n", {}, "'port'"),
        ("prot: 8080\n", {}, "'prot' (from config file"),
        # A model is a path or an upstream: neither is named as the choice it is.
        ("models:\n  - {name: a}\n", {}, "a model needs a path (its weights here) or an upstream"),
        ("models:\n  - {name: a, path: x}\n  - {name: a, path: y}\n", {}, "appears twice"),
        ("engine:\n  kv_cache_bytes: lots\n", {}, "'engine.kv_cache_bytes'"),
        ("dtype: float8\n", {}, "'dtype'"),
        ("- just\n- a list\n", {}, "mapping"),
        ("port: [\n", {}, "not valid YAML"),
        ("", {"INFERFLUX_PORT": "eighty"}, "(from INFERFLUX_PORT)"),
        ("engine:\n  speculative: {k: 0}\n", {}, "'engine.speculative.k'"),
        ("models:\n  - {name: a, path: x, speculative: {method: medusa}}\n", {}, "'models[0].speculative.method'"),
        ("engine:\n  speculative: {min_ngram: 3, max_ngram: 2}\n", {}, "min_ngram must not exceed max_ngram"),
        ("engine:\n  preemption_mode: drop\n", {}, "'engine.preemption_mode'"),
        ("engine:\n  speculative: {method: draft}\n", {}, "needs draft_layers or draft_model"),
        ("engine:\n  speculative: {draft_layers: 4}\n", {}, "apply to method 'draft' only"),
        ("", {"INFERFLUX_CPU_ISA": "avx1024"}, "'runtime.cpu_isa' (from INFERFLUX_CPU_ISA)"),
    ],
    ids=["port-range", "unknown-key", "model-path", "duplicate", "size", "dtype", "list", "yaml", "env", "spec-k",
         "spec-method", "spec-ngrams", "preemption-mode", "draft-missing", "draft-on-ngram", "cpu-isa"],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text), env=env)
    assert expected in str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "absent.yaml", env={})


def test_data_dir_is_private(tmp_path: Path) -> None:
    path = ensure_data_dir(tmp_path / "a" / "inferflux")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_serve_with_bad_config_exits_2_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "port: nope\n")
    assert cli.main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "inferctl: error: invalid setting 'port'" in err
    assert "Traceback" not in err


def test_serve_with_bad_flag_value_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--data-dir", str(tmp_path), "--kv-cache-bytes", "much"]) == 2
    assert "(from --kv-cache-bytes)" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"], ["models", "--help"], ["chat", "--help"]])
def test_help_runs(args: list[str]) -> None:
    result = subprocess.run([*INFERCTL, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: inferctl" in result.stdout


def test_serve_help_documents_flags() -> None:
    out = subprocess.run([*INFERCTL, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ("--model", "--backend", "--host", "--port", "--data-dir", "--config", "--dtype", "--log-level",
                 "--no-websocket"):
        assert flag in out
    assert "INFERFLUX_PORT" in out


def test_models_command_against_live_server(
    live_server: str, admin_key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["models", "--url", live_server, "--api-key", admin_key]) == 0
    assert DEFAULT_MODEL_NAME in capsys.readouterr().out


def test_client_command_without_key_reports_401(live_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "--url", live_server]) == 1
    err = capsys.readouterr().err
    assert "401" in err and "credentials" in err.lower()
    assert "Traceback" not in err


def test_complete_and_chat_commands(live_server: str, admin_key: str, capsys: pytest.CaptureFixture[str]) -> None:
    key = ["--url", live_server, "--api-key", admin_key]
    assert cli.main(["complete", "Hello", *key, "--max-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
    assert cli.main(["chat", "Hi", *key, "--max-tokens", "3", "--no-stream"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_command_with_tools(live_server: str, admin_key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 stream: bool) -> None:  # fmt: skip
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}}, "required": ["city"]}}}]))  # fmt: skip
    key = ["--url", live_server, "--api-key", admin_key, "--max-tokens", "20", "--temperature", "0"]
    args = ["chat", "Time in Rome?", *key, "--tools", str(tools), "--tool-choice", "get_time"]
    assert cli.main(args + ([] if stream else ["--no-stream"])) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tool call: ")]
    assert line.startswith("tool call: get_time(") and json.loads(line[len("tool call: get_time("):-1])["city"]
    tools.write_text("{}")
    assert cli.main(["chat", "x", *key, "--tools", str(tools)]) == 1
    assert "JSON list of tools" in capsys.readouterr().err


def test_embed_command(live_server: str, admin_key: str, capsys: pytest.CaptureFixture[str]) -> None:
    key = ["--url", live_server, "--api-key", admin_key]
    assert cli.main(["embed", "Hello", "the sea", *key]) == 0
    lines = capsys.readouterr().out.splitlines()
    vectors = [json.loads(line) for line in lines]
    assert len(vectors) == 2 and all(len(v) == 576 for v in vectors)
    assert abs(sum(x * x for x in vectors[0]) - 1) < 1e-4  # normalised
    assert cli.main(["embed", "Hello", *key, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["usage"]["prompt_tokens"] > 0
    assert cli.main(["embed", "Hello", *key, "--dimensions", "8"]) == 1  # not a Matryoshka model: the server's 400
    err = capsys.readouterr().err
    assert "dimensions" in err and "Traceback" not in err


def test_client_command_reports_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_serve_with_unavailable_backend_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = tmp_path / "data"
    assert cli.main(["serve", "--data-dir", str(data_dir), "--backend", "no-such-backend"]) == 1
    err = capsys.readouterr().err
    assert "cannot load model 'smollm2-135m-instruct'" in err and "no-such-backend" in err
    # The store was opened first: a new one announces its platform-admin key, once.
    assert "A platform-admin API key was created" in err and "ifx_" in err
    assert cli.main(["serve", "--data-dir", str(data_dir), "--backend", "no-such-backend"]) == 1
    assert "A platform-admin API key was created" not in capsys.readouterr().err
    assert "Traceback" not in err
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
