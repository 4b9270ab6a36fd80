"""engine.deterministic and models[].deterministic reach the ModelSpec each model loads with."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


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
    upstream = {"endpoints": ["http://10.0.0.5:8000/v1"]}
    with pytest.raises(ValidationError, match="deterministic applies to local models"):
        Settings(models=[{"name": "r", "upstream": upstream, "deterministic": True}])
    assert _specs(engine={"deterministic": True}, models=[{"name": "r", "upstream": upstream}]) == {"r": False}


def test_not_a_boolean_is_refused():
    with pytest.raises(ValidationError, match="deterministic"):
        Settings(engine={"deterministic": "sometimes"})


def test_inferctl_backends_json_reports_each_models_flag(tmp_path, capsys):
    from gateway.cli import main

    config = tmp_path / "inferflux.yaml"
    config.write_text("engine:\n  deterministic: true\nmodels:\n"
                      "  - {name: a, path: /m.gguf}\n  - {name: b, path: /m.gguf, deterministic: false}\n")
    assert main(["backends", "--json", "--config", str(config)]) == 0
    import json

    models = {m["name"]: m["deterministic"] for m in json.loads(capsys.readouterr().out)["models"]}
    assert models == {"a": True, "b": False}
