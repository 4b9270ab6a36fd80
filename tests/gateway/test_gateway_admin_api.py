"""Models loaded, made default, persisted, restored and unloaded at run time over the admin API.

Pagination, body validation and the OpenAPI document are covered in
``test_gateway_admin_behaviour.py`` and ``test_gateway_authz.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from inferflux.backends.models import default_model_path
from inferflux.gateway.models.admin import ModelAdmin
from inferflux.gateway.models.served import ModelManager
from inferflux.gateway.settings import Settings
from inferflux.policy.store import PolicyStore, StoreSettings

LOAD_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir: Path = tmp_path_factory.mktemp("admin-api")
    store = PolicyStore.open(StoreSettings(), data_dir)
    admin = store.ensure_bootstrap_admin()
    tenant = store.create_tenant("acme")
    tenant_admin = store.create_api_key(tenant.id, "admin", "tenant-admin")[1]
    app = make_app(store, engine={"kv_cache_bytes": 32 * 1024 * 1024})
    with TestClient(app) as client:
        yield {
            "store": store,
            "app": app,
            "client": client,
            "admin": {"authorization": f"Bearer {admin}"},
            "tenant_admin": {"authorization": f"Bearer {tenant_admin}"},
            "tenant": tenant,
            "data_dir": data_dir,
        }
    # The app does not own the engines: shut down what the tests loaded, also after a failure.
    for model in app.state.manager:
        if model.name not in app.state.model_admin.configured:
            model.shutdown()
    store.close()


def wait_loaded(client: TestClient, headers: dict[str, str], name: str) -> dict[str, Any]:
    deadline = time.monotonic() + LOAD_TIMEOUT
    stages = set()
    while True:
        status = client.get(f"/admin/v1/models/{name}", headers=headers).json()
        stages.add(status.get("stage"))
        if status["status"] != "loading":
            status["stages_seen"] = stages
            return status
        assert time.monotonic() < deadline, f"{name} still loading: {status}"
        time.sleep(0.05)


def test_load_serve_default_persist_and_unload_a_model(world: dict[str, Any]) -> None:
    client, admin, store = world["client"], world["admin"], world["store"]
    body = {"name": "second", "path": default_model_path(), "dtype": "float32", "aliases": ["twin"]}

    # Not for a tenant admin; validation before anything starts.
    assert client.post("/admin/v1/models", headers=world["tenant_admin"], json=body).status_code == 404  # platform-only
    bad_path = client.post("/admin/v1/models", headers=admin, json={**body, "path": "/no/such/model.gguf"})
    assert bad_path.status_code == 422 and bad_path.json()["error"]["param"] == "path"
    taken = client.post("/admin/v1/models", headers=admin, json={**body, "name": "smollm2-135m-instruct"})
    assert taken.status_code == 409
    assert client.post("/admin/v1/models", headers=admin, json={**body, "backend": "no-such"}).status_code == 422

    started = client.post("/admin/v1/models", headers=admin, json=body)
    assert started.status_code == 202, started.text
    assert started.json()["status"] == "loading"
    assert client.post("/admin/v1/models", headers=admin, json=body).status_code == 409  # already loading
    loaded = wait_loaded(client, admin, "second")
    assert loaded["status"] == "ready", loaded
    assert loaded["source"] == "admin" and loaded["aliases"] == ["twin"] and loaded["default"] is False

    # Served at once, by name and alias, to callers allowed every model.
    ids = [m["id"] for m in client.get("/v1/models", headers=admin).json()["data"]]
    assert ids.count("second") == 1
    chat = {"model": "twin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = client.post("/v1/chat/completions", headers=admin, json=chat)
    assert answer.status_code == 200 and answer.json()["model"] == "second"

    # Default; recorded in the store.
    assert client.post("/admin/v1/models/second/default", headers=admin).json()["default"] is True
    record = store.get_served_model_by_name("second")
    assert record.is_default and record.aliases == ("twin",) and record.dtype == "float32"
    listed = {m["id"]: m for m in client.get("/admin/v1/models", headers=admin).json()["data"]}
    assert listed["second"]["default"] and not listed["smollm2-135m-instruct"]["default"]

    # A restart serves the same set: restore() on a fresh manager loads it from the store.
    settings = Settings(data_dir=world["data_dir"], engine={"kv_cache_bytes": 32 * 1024 * 1024})
    manager = ModelManager()
    try:
        assert ModelAdmin(manager, store, settings, configured=set()).restore() == []
        assert [m.name for m in manager] == ["second"] and manager.default_name == "second"
    finally:
        manager.shutdown()

    # The configured model cannot be unloaded here; the admin-loaded one can, and is forgotten.
    assert client.delete("/admin/v1/models/smollm2-135m-instruct", headers=admin).status_code == 409
    assert client.delete("/admin/v1/models/second", headers=admin).status_code == 204
    assert client.get("/admin/v1/models/second", headers=admin).status_code == 404
    assert "second" not in [m["id"] for m in client.get("/v1/models", headers=admin).json()["data"]]
    assert store.list_served_models() == []
    assert client.post("/v1/chat/completions", headers=admin, json=chat).status_code == 404


def test_a_failed_load_is_reported_not_raised(world: dict[str, Any], tmp_path: Path) -> None:
    client, admin = world["client"], world["admin"]
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)  # the right name and magic, nothing loadable
    started = client.post("/admin/v1/models", headers=admin, json={"name": "broken", "path": str(broken)})
    assert started.status_code == 202
    status = wait_loaded(client, admin, "broken")
    assert status["status"] == "failed" and status["error"]
    assert world["store"].list_served_models() == []
    assert client.delete("/admin/v1/models/broken", headers=admin).status_code == 204  # forget it
    assert client.get("/admin/v1/models/broken", headers=admin).status_code == 404


def test_a_models_embedding_section_is_loaded_kept_and_restored(world: dict[str, Any]) -> None:
    """The admin API's load takes the section a configuration file's models[] take, checks it the same way,
    stores it with the model, serves /v1/embeddings by it, and a restart restores it."""
    import numpy as np

    client, admin, store = world["client"], world["admin"], world["store"]
    section = {"pooling": "last", "normalize": True, "matryoshka": True, "token_ids": True}
    body = {"name": "pooled", "path": default_model_path(), "dtype": "float32", "embedding": section}
    for bad, param in (({"pooling": "max"}, "embedding.pooling"), ({"pool": "mean"}, "embedding.pool")):
        refused = client.post("/admin/v1/models", headers=admin, json={**body, "embedding": bad})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == param, refused.text
    remote = {"name": "far", "upstream": {"endpoints": ["http://upstream.invalid/v1"]}, "embedding": section}
    refused = client.post("/admin/v1/models", headers=admin, json=remote)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "embedding", refused.text

    assert client.post("/admin/v1/models", headers=admin, json=body).status_code == 202
    loaded = wait_loaded(client, admin, "pooled")
    assert loaded["status"] == "ready" and loaded["embedding"] == section, loaded
    assert store.get_served_model_by_name("pooled").embedding == section

    def embed(model: str, **fields: Any) -> Any:
        return client.post("/v1/embeddings", headers=admin, json={"model": model, "input": "Hello there", **fields})

    full = np.array(embed("pooled").json()["data"][0]["embedding"])
    cut = embed("pooled", dimensions=64)
    assert cut.status_code == 200, cut.text  # matryoshka: it may shorten its vectors
    head = full[:64] / np.linalg.norm(full[:64])
    np.testing.assert_allclose(cut.json()["data"][0]["embedding"], head, atol=1e-5)
    assert embed("smollm2-135m-instruct", dimensions=64).status_code == 400  # the configured model may not
    mean = np.array(embed("smollm2-135m-instruct").json()["data"][0]["embedding"])
    assert not np.allclose(full, mean, atol=1e-3)  # last-token pooling, not the default mean
    assert embed("pooled", input=[[17, 42]]).status_code == 200  # token_ids: its clients send its own ids
    refused = embed("smollm2-135m-instruct", input=[17, 42])
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "token_ids_not_enabled", refused.text

    settings = Settings(data_dir=world["data_dir"], engine={"kv_cache_bytes": 32 * 1024 * 1024})
    manager = ModelManager()
    try:
        assert ModelAdmin(manager, store, settings, configured=set()).restore() == []
        assert manager.get("pooled").embedding == section
    finally:
        manager.shutdown()
    assert client.delete("/admin/v1/models/pooled", headers=admin).status_code == 204


def test_v1_models_says_what_each_model_serves(world: dict[str, Any]) -> None:
    client, admin = world["client"], world["admin"]
    cards = client.get("/v1/models", headers=admin).json()["data"]
    assert {card["id"]: card["capabilities"] for card in cards}["smollm2-135m-instruct"] == [
        "chat", "completions", "embeddings"]  # fmt: skip
    one = client.get("/v1/models/smollm2", headers=admin).json()
    assert one["capabilities"] == ["chat", "completions", "embeddings"]


def test_inferctl_served_models_load_passes_the_embedding_section(tmp_path: Path) -> None:
    from inferflux.gateway.cli import build_parser
    from inferflux.gateway.cli.served_models import _load_body

    upstream = tmp_path / "up.json"
    upstream.write_text('{"endpoints": ["http://10.0.0.5:8000/v1"]}')
    args = build_parser().parse_args(["served-models", "load", "m", "--path", "/models/m.gguf", "--alias", "a",
                                      "--alias", "b", "--pooling", "last", "--no-normalize", "--matryoshka",
                                      "--token-ids"])  # fmt: skip
    assert _load_body(args) == {"name": "m", "path": "/models/m.gguf", "aliases": ["a", "b"], "default": False,
                                "embedding": {"pooling": "last", "normalize": False, "matryoshka": True,
                                              "token_ids": True}}  # fmt: skip
    args = build_parser().parse_args(["served-models", "load", "far", "--upstream", f"@{upstream}", "--default"])
    assert _load_body(args) == {"name": "far", "aliases": [], "default": True,
                                "upstream": {"endpoints": ["http://10.0.0.5:8000/v1"]}}


def test_a_deterministic_model_is_loaded_reported_kept_and_restored(world: dict[str, Any]) -> None:
    """deterministic on the admin API's load: refused on an upstream model and when not a boolean, stored with
    the model, reported by GET /admin/v1/models/{id}, and restored with it."""
    client, admin, store = world["client"], world["admin"], world["store"]
    body = {"name": "invariant", "path": default_model_path(), "dtype": "bfloat16", "deterministic": True}
    refused = client.post("/admin/v1/models", headers=admin, json={**body, "deterministic": "yes"})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "deterministic", refused.text
    remote = {"name": "far", "upstream": {"endpoints": ["http://upstream.invalid/v1"]}, "deterministic": True}
    refused = client.post("/admin/v1/models", headers=admin, json=remote)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "deterministic", refused.text

    assert client.post("/admin/v1/models", headers=admin, json=body).status_code == 202
    loaded = wait_loaded(client, admin, "invariant")
    assert loaded["status"] == "ready" and loaded["deterministic"] is True, loaded
    assert client.get("/admin/v1/models/smollm2", headers=admin).json()["deterministic"] is False
    assert store.get_served_model_by_name("invariant").deterministic is True

    settings = Settings(data_dir=world["data_dir"], engine={"kv_cache_bytes": 32 * 1024 * 1024})
    manager = ModelManager()
    try:
        assert ModelAdmin(manager, store, settings, configured=set()).restore() == []
        assert manager.get("invariant").info.deterministic is True
    finally:
        manager.shutdown()
    assert client.delete("/admin/v1/models/invariant", headers=admin).status_code == 204


def test_inferctl_served_models_load_passes_deterministic() -> None:
    from inferflux.gateway.cli import build_parser
    from inferflux.gateway.cli.served_models import _load_body

    for flag, value in (("--deterministic", True), ("--no-deterministic", False)):
        args = build_parser().parse_args(["served-models", "load", "m", "--path", "/m.gguf", flag])
        assert _load_body(args)["deterministic"] is value
    assert "deterministic" not in _load_body(build_parser().parse_args(["served-models", "load", "m", "--path", "/m"]))


def test_a_models_load_passes_are_validated_run_kept_and_restored(world: dict[str, Any]) -> None:
    """passes on the admin API's load: refused (naming passes) for a bad mode, an unknown key, a gemm_from out
    of range, a dense mode contradicting the dtype and an upstream model; run at load (GET shows the int8 pass's
    record with fewer weight bytes after), kept in the registry and loaded with them again by another replica."""
    client, admin, store = world["client"], world["admin"], world["store"]
    body = {"name": "int8", "path": default_model_path(), "passes": {"quantise": "int8", "gemm_from": 32}}
    for bad in ({"quantise": "int3"}, {"quantize": "int8"}, {"gemm_from": 0}, {"quantise": "bf16"}, {"pack": "maybe"},
                {"decode_loop": "maybe"}):
        refused = client.post("/admin/v1/models", headers=admin, json={**body, "passes": bad, "dtype": "float32"})
        assert refused.status_code == 422 and refused.json()["error"]["param"].startswith("passes"), refused.text
    remote = {"name": "far", "upstream": {"endpoints": ["http://upstream.invalid/v1"]}, "passes": {"quantise": "int8"}}
    refused = client.post("/admin/v1/models", headers=admin, json=remote)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "passes", refused.text

    accepted = client.post("/admin/v1/models", headers=admin, json=body)
    assert accepted.status_code == 202 and accepted.json()["passes_requested"] == body["passes"], accepted.text
    loaded = wait_loaded(client, admin, "int8")
    assert loaded["status"] == "ready", loaded
    quantise = next(r for r in loaded["passes"] if r["name"] == "quantise")
    assert quantise["status"] == "ran" and quantise["bytes_after"] < quantise["bytes_before"], quantise
    assert store.get_served_model_by_name("int8").passes == {"quantise": "int8", "gemm_from": 32}
    trail = client.get("/admin/v1/audit", params={"limit": 200}, headers=admin).json()["data"]
    event = next(e for e in reversed(trail) if e["action"] == "model.load" and e["target_id"] == "int8")
    assert event["detail"]["passes"] == {"quantise": "int8", "gemm_from": 32}

    settings = Settings(data_dir=world["data_dir"], engine={"kv_cache_bytes": 32 * 1024 * 1024})
    manager = ModelManager()
    try:
        assert ModelAdmin(manager, store, settings, configured=set()).restore() == []
        restored = {r["name"]: r for r in manager.get("int8").info.passes}["quantise"]
        assert restored["detail"] == quantise["detail"] and restored["bytes_after"] == quantise["bytes_after"]
    finally:
        manager.shutdown()
    assert client.delete("/admin/v1/models/int8", headers=admin).status_code == 204


def test_inferctl_served_models_load_passes_the_load_passes() -> None:
    from inferflux.gateway.cli import build_parser
    from inferflux.gateway.cli.served_models import _load_body

    args = build_parser().parse_args(["served-models", "load", "m", "--path", "/m.gguf", "--quantise", "native",
                                      "--gemm-from", "32"])
    assert _load_body(args)["passes"] == {"quantise": "native", "gemm_from": 32}
    args = build_parser().parse_args(["served-models", "load", "m", "--path", "/m.gguf", "--quantise", "int4"])
    assert _load_body(args)["passes"] == {"quantise": "int4"}
    args = build_parser().parse_args(["served-models", "load", "m", "--path", "/m.gguf", "--no-pack"])
    assert _load_body(args)["passes"] == {"pack": False}
    args = build_parser().parse_args(["served-models", "load", "m", "--path", "/m.gguf", "--no-decode-loop"])
    assert _load_body(args)["passes"] == {"decode_loop": False}
    assert "passes" not in _load_body(build_parser().parse_args(["served-models", "load", "m", "--path", "/m"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["served-models", "load", "m", "--path", "/m", "--quantise", "int3"])
