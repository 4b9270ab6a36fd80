"""Model manifests (issue 48): a directory polled by a real server over a real socket.

A manifest added loads its model, changed reloads it (swapped in once ready),
removed drains it while a request in flight finishes; a bad one is reported
(``/readyz``, the gauge, one log line per version) and changes nothing, and is
cleared once fixed. No request in the whole run is answered with a 5xx.
The files' rules (which count, links, size, YAML and schema errors) are
checked without a server at the end.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferflux.backends.models import default_model_path
from inferflux.gateway import cli
from inferflux.gateway.models.manifest_files import ManifestError, counts, parse, scan
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from inferflux.policy.store import PolicyStore, StoreSettings
from audit_wait import eventually
from servers import start_uvicorn, stop_uvicorn

POLL = 0.1
LOAD_TIMEOUT = 180.0  # a load of the 135M model on a loaded 2-core machine
SECRET = "sk-manifest-secret-0123456789"


def manifest(directory: Path, file: str, **entry: Any) -> None:
    """Write ``file`` whole at once, as a deployment tool does (a dotfile renamed over it: the poll ignores
    dotfiles, and never sees the file half written)."""
    temporary = directory / f".{file}.tmp"
    temporary.write_text(json.dumps(entry))  # JSON is YAML
    os.replace(temporary, directory / file)


def model_entry(**extra: Any) -> dict[str, Any]:
    return {"name": "manifested", "path": default_model_path(), "dtype": "float32", **extra}


@pytest.fixture(scope="module")
def server(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    store = PolicyStore.open(StoreSettings(), tmp_path_factory.mktemp("manifest-store"))
    directory = tmp_path_factory.mktemp("manifests")
    app = make_app(store, engine={"kv_cache_bytes": 32 * 1024 * 1024},
                   registry={"path": str(directory), "poll_interval_seconds": POLL},
                   server={"shutdown_grace_seconds": 60})  # fmt: skip
    live = start_uvicorn(app)
    headers = {"authorization": f"Bearer {store.ensure_bootstrap_admin()}"}
    try:
        with httpx.Client(base_url=live[3], headers=headers, timeout=120) as client:
            yield {"client": client, "dir": directory, "app": app}
    finally:
        stop_uvicorn(*live[:3])
        for model in app.state.manager:  # the app does not own the engines: stop what the manifests loaded
            if model.name != DEFAULT_MODEL_NAME:
                model.shutdown()
        store.close()


def served(client: httpx.Client) -> list[str]:
    return [m["id"] for m in client.get("/v1/models").json()["data"]]


def chat(client: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    return client.post("/v1/chat/completions", json=body)


def describe(client: httpx.Client, name: str) -> dict[str, Any]:
    response = client.get(f"/admin/v1/models/{name}")
    return response.json() if response.status_code == 200 else {"status": response.status_code}


def manifest_errors(client: httpx.Client) -> dict[str, str]:
    response = client.get("/readyz")
    assert response.status_code == 200, response.text  # a bad manifest never makes the replica unready
    return response.json().get("manifest_errors", {})


def error_series(client: httpx.Client) -> dict[str, float]:
    lines = client.get("/metrics").text.splitlines()
    prefix = 'inferflux_registry_manifest_errors{file="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix)}


def test_manifests_load_reload_report_and_drain(server: dict[str, Any], caplog: pytest.LogCaptureFixture,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    client, directory = server["client"], server["dir"]

    # Added: loaded, served under its name and alias, owned by its file.
    manifest(directory, "twin.yaml", **model_entry(aliases=["m-one"]))
    eventually(lambda: served(client), lambda ids: "manifested" in ids, timeout=LOAD_TIMEOUT, what="the load")
    assert chat(client, "m-one").status_code == 200
    assert describe(client, "manifested")["source"] == "manifest"
    assert client.delete("/admin/v1/models/manifested").status_code == 409  # its file is where it changes
    first_engine = server["app"].state.manager.get("manifested").engine

    # Changed: the new version loads beside the old, then takes its place.
    manifest(directory, "twin.yaml", **model_entry(aliases=["m-two"]))
    eventually(lambda: describe(client, "manifested").get("aliases"), lambda a: a == ["m-two"],
               timeout=LOAD_TIMEOUT, what="the reload")  # fmt: skip
    assert chat(client, "m-two").status_code == 200
    assert chat(client, "m-one").status_code == 404
    eventually(lambda: first_engine.is_running, lambda running: not running, what="the old version drained")

    # Bad: a schema error carrying a secret, YAML that does not parse, a model file that is not there,
    # a name the configuration file serves. Each reported by file name; the version served keeps serving.
    with caplog.at_level(logging.ERROR, logger="inferflux.gateway.models.manifests"):
        manifest(directory, "twin.yaml", **model_entry(aliases=["m-three"], upstream_api_key=SECRET))
        (directory / "broken.yml").write_text("name: [unclosed\n")
        manifest(directory, "missing.yaml", name="nowhere", path=str(directory / "absent" / "model.gguf"))
        manifest(directory, "clash.yaml", name=DEFAULT_MODEL_NAME, path=default_model_path())
        manifest(directory, "dup.yaml", name="dup", path=default_model_path(), dtype="float32", aliases=["m-two"])
        errors = eventually(lambda: manifest_errors(client), lambda e: len(e) == 5, timeout=30, what="the reports")
        time.sleep(10 * POLL)  # ten more polls: each version is logged once, not at every poll
    assert set(errors) == {"twin.yaml", "broken.yml", "missing.yaml", "clash.yaml", "dup.yaml"}
    assert "'m-two' is already served (model 'manifested', from manifest twin.yaml)" in errors["dup.yaml"]
    assert "upstream_api_key" in errors["twin.yaml"] and "unknown key" in errors["twin.yaml"]
    assert "YAML" in errors["broken.yml"] and "configuration file" in errors["clash.yaml"]
    assert "path" in errors["missing.yaml"]
    readyz = client.get("/readyz").text
    assert SECRET not in readyz and str(directory) not in readyz and SECRET not in caplog.text
    assert set(error_series(client)) == set(errors) and set(error_series(client).values()) == {1.0}
    for file in errors:  # each logged once, though the name conflict is tried again at every poll
        logged = [r.getMessage() for r in caplog.records if f"manifest {file} " in r.getMessage()]
        assert len(logged) == 1, logged
    assert chat(client, "m-two").status_code == 200  # the previous version still serves
    assert chat(client, "nowhere").status_code == 404
    capsys.readouterr()
    assert cli.main(["status", "--url", str(client.base_url)]) == 0  # ready: the errors are reported, not fatal
    out = capsys.readouterr().out
    assert "manifest: broken.yml: not valid YAML" in out and "manifest: twin.yaml: invalid" in out

    # Fixed: twin.yaml lets m-two go, so dup.yaml, tried at every poll, loads; the others are removed.
    # Every report clears, the gauge's series with it.
    manifest(directory, "twin.yaml", **model_entry(aliases=["m-four"]))
    for file in ("broken.yml", "missing.yaml", "clash.yaml"):
        (directory / file).unlink()
    eventually(lambda: manifest_errors(client), lambda e: not e, timeout=LOAD_TIMEOUT, what="the reports clearing")
    assert error_series(client) == {}
    assert describe(client, "dup")["aliases"] == ["m-two"] and chat(client, "m-two").status_code == 200
    assert chat(client, "m-four").status_code == 200
    (directory / "dup.yaml").unlink()
    eventually(lambda: served(client), lambda ids: "dup" not in ids, timeout=10, what="dup's removal")

    # Removed while a request is in flight: new requests get 404 at once, the one in flight finishes.
    finished: dict[str, Any] = {}
    started = threading.Event()

    def stream() -> None:
        body = {"model": "manifested", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 48,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            finished["status"] = response.status_code
            lines = []
            for line in response.iter_lines():
                started.set()
                if line:  # not the blank lines between events
                    lines.append(line)
            finished["lines"] = lines

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    (directory / "twin.yaml").unlink()
    eventually(lambda: served(client), lambda ids: "manifested" not in ids, timeout=10, what="the removal")
    assert chat(client, "manifested").status_code == 404
    reader.join(120)
    assert finished["status"] == 200 and finished["lines"][-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in finished["lines"] if line.startswith("data: {")]
    assert not any("error" in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # Not one 5xx in the whole run.
    statuses = [line for line in client.get("/metrics").text.splitlines()
                if line.startswith("inferflux_http_requests_total{") and 'status="5' in line]  # fmt: skip
    assert not statuses, statuses


def test_which_files_count_and_how_a_bad_one_reads(tmp_path: Path) -> None:
    assert counts("a.yaml") and counts("b.YML")
    assert not any(counts(n) for n in (".hidden.yaml", "a.yaml~", "#a.yaml#", "a.yaml.swp", "a.json", ".a.yaml.swp"))
    (tmp_path / "good.yaml").write_text(f"name: x\npath: {default_model_path()}\n")
    (tmp_path / "big.yaml").write_text("name: x\n" + "#" * 2048)
    (tmp_path / "sub.yaml").mkdir()
    outside = tmp_path.parent / f"{tmp_path.name}-outside.yaml"
    outside.write_text("name: y\npath: /x.gguf\n")
    os.symlink(outside, tmp_path / "link.yaml")
    # A ConfigMap's layout: each file a link into ..data, itself a link to the current version's folder.
    (tmp_path / "..2026_12_07").mkdir()
    (tmp_path / "..2026_12_07" / "cm.yaml").write_text("name: cm\npath: /cm.gguf\n")
    os.symlink("..2026_12_07", tmp_path / "..data")
    os.symlink("..data/cm.yaml", tmp_path / "cm.yaml")
    (tmp_path / ".swap.yaml").write_text("not: read")
    files = scan(tmp_path, max_bytes=1024)
    assert set(files) == {"good.yaml", "big.yaml", "sub.yaml", "link.yaml", "cm.yaml"}
    assert parse(files["good.yaml"]).name == "x" and parse(files["cm.yaml"]).name == "cm"
    for name, why in (("big.yaml", "max_manifest_bytes"), ("sub.yaml", "regular file"), ("link.yaml", "out of the directory")):
        with pytest.raises(ManifestError, match=why):
            parse(files[name])
    assert str(tmp_path) not in files["link.yaml"].error  # type: ignore[operator]
    # The same content hashes the same (no reload), another content not (a reload).
    again = scan(tmp_path, max_bytes=1024)
    assert again["good.yaml"].digest == files["good.yaml"].digest
    (tmp_path / "good.yaml").write_text(f"name: x\npath: {default_model_path()}\naliases: [z]\n")
    assert scan(tmp_path, max_bytes=1024)["good.yaml"].digest != files["good.yaml"].digest
    with pytest.raises(ManifestError, match="mapping"):
        parse(scan_one(tmp_path, "list.yaml", "- a\n- b\n"))
    with pytest.raises(ManifestError, match="upstream"):  # the configuration file's rules, e.g. no path and upstream
        parse(scan_one(tmp_path, "both.yaml", "name: x\npath: /m.gguf\nupstream: {endpoints: [http://h/v1]}\n"))
    with pytest.raises(ManifestError, match="unknown key"):  # no plain-text key: a credential or api_key_env
        parse(scan_one(tmp_path, "key.yaml", "name: x\nupstream: {endpoints: [http://h/v1], api_key: sk-1}\n"))


def scan_one(directory: Path, name: str, text: str) -> Any:
    (directory / name).write_text(text)
    return scan(directory, max_bytes=1024)[name]


@pytest.mark.model  # loads the real model itself (through a manifest), without a model fixture
def test_a_stop_during_a_load_stops_the_model_it_was_loading(tmp_path: Path) -> None:
    """The app stopping while a manifest's model loads: the load finishes on its thread, is never served,
    and its engine is stopped (no engine thread left running behind the app)."""
    import asyncio

    from inferflux.gateway.models.admin import ModelAdmin
    from inferflux.gateway.models.manifests import ManifestWatcher
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings

    directory = tmp_path / "manifests"
    directory.mkdir()
    manifest(directory, "late.yaml", **model_entry(name="late"))
    settings = Settings(data_dir=tmp_path / "data", engine={"kv_cache_bytes": 8 * 1024 * 1024},
                        registry={"path": str(directory), "poll_interval_seconds": POLL})  # fmt: skip
    store = PolicyStore.open(StoreSettings(), tmp_path / "store")
    manager = ModelManager()

    async def scenario() -> Any:
        watcher = ManifestWatcher(ModelAdmin(manager, store, settings, set()), settings.registry, grace=5)
        watcher.start()
        while watcher._loading is None:
            await asyncio.sleep(0.01)
        loading = watcher._loading
        await watcher.stop()
        return loading.result()

    try:
        orphan = asyncio.run(scenario())
    finally:
        store.close()
    assert orphan.name == "late" and not orphan.engine.is_running
    assert len(manager) == 0


def test_the_registry_settings_and_their_sources(tmp_path: Path) -> None:
    from inferflux.gateway.settings import ConfigError, load_settings

    env = {"INFERFLUX_REGISTRY_PATH": str(tmp_path), "INFERFLUX_REGISTRY_POLL_INTERVAL_SECONDS": "0.5",
           "INFERFLUX_DATA_DIR": str(tmp_path / "data")}  # fmt: skip
    settings = load_settings(env=env)
    assert settings.registry.path == tmp_path and settings.registry.poll_interval_seconds == 0.5
    flags = load_settings(env=env, overrides={"registry.poll_interval_seconds": 2.0})
    assert flags.registry.poll_interval_seconds == 2.0
    assert load_settings(env={"INFERFLUX_DATA_DIR": str(tmp_path / "data")}).registry.path is None
    with pytest.raises(ConfigError, match="registry.poll_interval_seconds.*INFERFLUX_REGISTRY_POLL_INTERVAL_SECONDS"):
        load_settings(env={**env, "INFERFLUX_REGISTRY_POLL_INTERVAL_SECONDS": "0.01"})


def test_a_directory_that_cannot_be_listed_is_reported_and_changes_nothing(tmp_path: Path) -> None:
    import asyncio

    from inferflux.gateway.models.admin import ModelAdmin
    from inferflux.gateway.models.manifests import DIRECTORY, ManifestWatcher
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings

    directory = tmp_path / "not-mounted"
    settings = Settings(data_dir=tmp_path / "data", registry={"path": str(directory)})
    store = PolicyStore.open(StoreSettings(), tmp_path / "store")
    try:
        watcher = ManifestWatcher(ModelAdmin(ModelManager(), store, settings, set()), settings.registry, grace=1)
        asyncio.run(watcher.poll())
        errors = watcher.errors()
        assert list(errors) == [DIRECTORY] and "cannot be listed" in errors[DIRECTORY]
        assert str(tmp_path) not in errors[DIRECTORY]
        directory.mkdir()  # mounted again: the report clears
        asyncio.run(watcher.poll())
        assert watcher.errors() == {}
    finally:
        store.close()
