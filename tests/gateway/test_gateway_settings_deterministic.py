"""engine.deterministic and models[].deterministic reach the ModelSpec each model loads with."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from inferflux.gateway.settings import Settings


def _specs(**settings: object) -> dict[str, bool]:
    return {spec.name: spec.deterministic for spec, _ in Settings(**settings).model_specs()}


def test_off_unless_asked():
    assert _specs(models=[{"name": "a", "path": "/m.gguf"}]) == {"a": False}


def test_a_model_overrides_the_engine_section():
    models = [{"name": "a", "path": "/m.gguf"}, {"name": "b", "path": "/m.gguf", "deterministic": False},
              {"name": "c", "path": "/m.gguf", "deterministic": True}]
    assert _specs(engine={"deterministic": True}, models=models) == {"a": True, "b": False, "c": True}
    assert _specs(models=models) == {"a": False, "b": False, "c": True}


def test_an_upstream_model_takes_neither_the_key_nor_the_engine_default():
    upstream = {"endpoints": ["http://vllm.example:8000/v1"]}
    with pytest.raises(ValidationError, match="deterministic applies to local models"):
        Settings(models=[{"name": "r", "upstream": upstream, "deterministic": True}])
    assert _specs(engine={"deterministic": True}, models=[{"name": "r", "upstream": upstream}]) == {"r": False}


def test_not_a_boolean_is_refused():
    with pytest.raises(ValidationError, match="deterministic"):
        Settings(engine={"deterministic": "sometimes"})


def test_inferctl_backends_json_reports_each_models_flag(tmp_path, capsys):
    from inferflux.gateway.cli import main

    config = tmp_path / "inferflux.yaml"
    config.write_text("engine:\n  deterministic: true\nmodels:\n"
                      "  - {name: a, path: /m.gguf}\n  - {name: b, path: /m.gguf, deterministic: false}\n")
    assert main(["backends", "--json", "--config", str(config)]) == 0
    import json

    models = {m["name"]: m["deterministic"] for m in json.loads(capsys.readouterr().out)["models"]}
    assert models == {"a": True, "b": False}


def test_inferctl_backends_json_plans_each_cpu_models_passes(tmp_path, capsys):
    """Per configured cpu model: the pass pipeline and the quantise mode its passes resolve to for its file
    here (auto on the shipped Q4_1 file: its own blocks where the kernels build), or why it would not load."""
    import json

    import torch

    from inferflux.backends.cpu import passes
    from inferflux.backends.models import default_model_path
    from inferflux.gateway.cli import main
    from inferflux.kernels import cpu as cpu_kernels

    config = tmp_path / "inferflux.yaml"
    config.write_text(f"backend: cpu\nmodels:\n  - {{name: auto, path: {default_model_path()}}}\n"
                      f"  - {{name: i4, path: {default_model_path()}, passes: {{quantise: int4}}}}\n"
                      f"  - {{name: f32, path: {default_model_path()}, dtype: float32}}\n"
                      "  - {name: gone, path: /nowhere/m.gguf}\n")
    assert main(["backends", "--json", "--config", str(config)]) == 0
    plans = {m["name"]: m["pass_plan"] for m in json.loads(capsys.readouterr().out)["models"]}
    kernels = cpu_kernels.load() is not None
    assert plans["auto"]["pipeline"] == [name for name, _ in passes.PASSES]
    # auto on this quantised file: with the kernels, exact on an AVX-512 build (bfloat16 needs its BF16) and
    # blocks below it (float32); without them the dense weights alone (bf16, f32).
    avx512 = cpu_kernels.isa().startswith("avx512")
    exact = {"bfloat16": "exact" if kernels and cpu_kernels.exact_linear_supported(torch.bfloat16) else "bf16",
             "float32": ("exact" if avx512 else "blocks") if kernels else "f32"}
    assert plans["auto"]["cpu_isa"] == (cpu_kernels.isa() or None)
    assert plans["auto"]["cpu_isa_requested"] == cpu_kernels.requested_isa()
    assert plans["auto"]["quantised_file"] is True and plans["auto"]["quantise"] == exact[plans["auto"]["dtype"]]
    assert plans["i4"]["quantise"] == "int4" and ("error" in plans["i4"]) is not kernels
    assert plans["f32"] == {**plans["f32"], "quantise": exact["float32"], "dtype": "float32"}
    assert plans["gone"]["quantise"] is None and "/nowhere/m.gguf" in plans["gone"]["error"]
