"""``POST /v1/embeddings`` on the real session model: OpenAI's shape, transformers' numbers, the policy chain.

The vectors are transformers' final hidden states (after the final norm) of the same
tokens, pooled and L2-normalised, within 1e-4 in float32; a batch of 64 inputs gives each
input the vector it gets alone; base64 is the same floats; token ids are the same inputs
as their text, on a model whose operator said its clients send its own ids (and are refused,
naming the fixes, on any other: LangChain's OpenAIEmbeddings, over a real socket, sends
OpenAI's ids by default). Errors are OpenAI-shaped 400s naming the parameter (``input[3]``). The
policy chain is the generation routes': 401, the model allow-list's 404, token quotas
charged the input tokens only, input guardrails (block and redact), OPA told the route,
and one audit event without the text.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from inferflux.backends.models import default_model_path
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from http_helpers import bearer, error_of
from inferflux.policy.store import PolicyStore, StoreSettings
from app_world import LiveWorld, open_live_world

MODEL = DEFAULT_MODEL_NAME
HIDDEN = 576  # SmolLM2-135M's hidden size
POLL = 0.05  # the apps here re-read policies this often
ATOL = 1e-4
TEXTS = ["The sea is calm tonight.", "Embeddings are pooled hidden states.", "a", "Quelle heure est-il ?"]


class World:
    def __init__(self, store: PolicyStore, app: Any, client: TestClient, data_dir: Path) -> None:
        self.store, self.app, self.client, self.data_dir = store, app, client, data_dir
        self.n = 0

    def tenant_key(self, **tenant: Any) -> tuple[Any, str]:
        """A fresh tenant with a member key: one test's policies never touch another's."""
        self.n += 1
        record = self.store.create_tenant(f"e{self.n}", **tenant)
        return record, self.store.create_api_key(record.id, "k", "member")[1]

    def embed(self, key: str, **body: Any) -> Any:
        return self.client.post("/v1/embeddings", json={"model": MODEL, **body}, headers=bearer(key))

    def settled(self) -> None:
        deadline = time.monotonic() + 10
        while self.app.state.traffic_tasks:
            assert time.monotonic() < deadline, "settlements did not finish"
            time.sleep(0.02)

    def policies_seen(self) -> None:
        time.sleep(3 * POLL)

    def events(self) -> dict[str, dict[str, Any]]:
        segments = sorted((self.data_dir / "audit" / "segments").glob("*.jsonl"))
        return {e["event"]["request_id"]: e["event"] for s in segments for line in s.read_text().splitlines()
                if (e := json.loads(line))}  # fmt: skip


def start_world(make_app: Any, data_dir: Path, **settings: Any) -> Iterator[World]:
    store = PolicyStore.open(StoreSettings(), data_dir)
    app = make_app(store, data_dir=str(data_dir), auth={"revocation_poll_seconds": POLL}, **settings)
    with TestClient(app) as client:
        yield World(store, app, client, data_dir)
    store.close()


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    yield from start_world(make_app, tmp_path_factory.mktemp("embeddings"))


@pytest.fixture(scope="module")
def last_world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The same model configured for last-token pooling, shortened (Matryoshka) vectors allowed."""
    entry = {"name": MODEL, "path": default_model_path(), "embedding": {"pooling": "last", "matryoshka": True}}
    yield from start_world(make_app, tmp_path_factory.mktemp("embeddings-last"), models=[entry])


@pytest.fixture(scope="module")
def ids_world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The same model configured to take token-id inputs as its own ids."""
    yield from start_world(make_app, tmp_path_factory.mktemp("embeddings-ids"), models=[ids_entry()])


def ids_entry() -> dict[str, Any]:
    return {"name": MODEL, "path": default_model_path(), "embedding": {"token_ids": True}}


@pytest.fixture(scope="module")
def key(world: World) -> str:
    return world.tenant_key()[1]


@pytest.fixture(scope="module")
def hidden_states(hf_smollm2: Any) -> Any:
    """``hidden_states(token_ids)``: transformers' final hidden states (after the final norm) of the default model."""
    import torch

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return hf_smollm2.model(torch.tensor([ids])).last_hidden_state[0].numpy()

    return run


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def vectors(response: Any) -> np.ndarray:
    assert response.status_code == 200, response.text
    body = response.json()
    assert [item["index"] for item in body["data"]] == list(range(len(body["data"])))
    return np.array([item["embedding"] for item in body["data"]], dtype=np.float32)


def tokens(served_model: Any, text: str) -> list[int]:
    return list(served_model.tokenizer.encode(text))


# -- the numbers ---------------------------------------------------------------------------


def test_embeddings_are_transformers_mean_pooled_hidden_states(world: World, key: str, served_model: Any,
                                                               hidden_states: Any) -> None:  # fmt: skip
    response = world.embed(key, input=TEXTS)
    got = vectors(response)
    body = response.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert all(item["object"] == "embedding" for item in body["data"])
    ids = [tokens(served_model, text) for text in TEXTS]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    want = np.stack([unit(hidden_states(i).mean(0)) for i in ids])
    assert got.shape == (len(TEXTS), HIDDEN)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_last_token_pooling_and_matryoshka_dimensions(last_world: World, served_model: Any,
                                                      hidden_states: Any) -> None:  # fmt: skip
    key = last_world.tenant_key()[1]
    ids = [tokens(served_model, text) for text in TEXTS]
    last = [hidden_states(i)[-1] for i in ids]
    np.testing.assert_allclose(vectors(last_world.embed(key, input=TEXTS)), np.stack([unit(v) for v in last]),
                               atol=ATOL, rtol=0)  # fmt: skip
    short = vectors(last_world.embed(key, input=TEXTS, dimensions=64))
    assert short.shape == (len(TEXTS), 64)
    np.testing.assert_allclose(short, np.stack([unit(v[:64]) for v in last]), atol=ATOL, rtol=0)
    too_many = last_world.embed(key, input="x", dimensions=HIDDEN + 1)
    assert too_many.status_code == 400 and error_of(too_many)["param"] == "dimensions"


def test_a_batch_of_64_inputs_gives_each_its_own_vector(world: World, key: str, served_model: Any,
                                                        hidden_states: Any) -> None:  # fmt: skip
    texts = [f"Input number {i}: " + "word " * (i % 13) for i in range(64)]
    batch = vectors(world.embed(key, input=texts))
    assert batch.shape == (64, HIDDEN)
    for i in (0, 17, 63):  # alone, the same vector; and transformers'
        np.testing.assert_allclose(vectors(world.embed(key, input=texts[i]))[0], batch[i], atol=1e-5, rtol=0)
        np.testing.assert_allclose(batch[i], unit(hidden_states(tokens(served_model, texts[i])).mean(0)),
                                   atol=ATOL, rtol=0)  # fmt: skip
    assert len({row.tobytes() for row in batch}) == 64


def test_base64_is_the_same_little_endian_float32s(world: World, key: str) -> None:
    floats = world.embed(key, input=TEXTS[:2]).json()["data"]
    encoded = world.embed(key, input=TEXTS[:2], encoding_format="base64").json()["data"]
    for f, e in zip(floats, encoded, strict=True):
        assert isinstance(e["embedding"], str)
        decoded = np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(f["embedding"], dtype=np.float32))


def test_token_id_inputs_are_the_texts_they_encode(ids_world: World, served_model: Any) -> None:
    _, key = ids_world.tenant_key()
    as_text = vectors(ids_world.embed(key, input=TEXTS[:2]))
    ids = [tokens(served_model, text) for text in TEXTS[:2]]
    np.testing.assert_allclose(vectors(ids_world.embed(key, input=ids)), as_text, atol=1e-5, rtol=0)
    np.testing.assert_allclose(vectors(ids_world.embed(key, input=ids[0]))[0], as_text[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("ids", [[17, 42], [[17, 42], [5]]])
def test_token_ids_are_refused_unless_the_model_takes_them(world: World, key: str, ids: Any) -> None:
    """Read as this model's ids, another tokenizer's would embed other text without an error: a 400 that
    names both fixes (send the text, as LangChain does with check_embedding_ctx_length=False; or the setting)."""
    refused = world.embed(key, input=ids)
    assert refused.status_code == 400, refused.text
    error = error_of(refused)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "input", "token_ids_not_enabled")
    assert "check_embedding_ctx_length=False" in error["message"] and "embedding.token_ids" in error["message"]


def test_langchain_openai_embeddings(live_server: str, admin_key: str, ids_world: World, world: World, key: str,
                                     make_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """LangChain's OpenAIEmbeddings over a real socket: by default it sends token ids (its tokenizer's), which
    a model not configured for them refuses with the fix; with check_embedding_ctx_length=False it sends the
    text, and gets the text's vector; a model whose operator opted in takes the ids as its own."""
    import openai
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    # OpenAI's vocabulary is a file tiktoken downloads on first use, and nothing is downloaded here: a
    # byte-level encoding stands in for it (its ids, 0-255, are in SmolLM2's vocabulary too).
    byte_level = tiktoken.Encoding(name="bytes", pat_str=r"[\s\S]", special_tokens={},
                                   mergeable_ranks={bytes([b]): b for b in range(256)})  # fmt: skip
    monkeypatch.setattr(tiktoken, "encoding_for_model", lambda _: byte_level)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda _: byte_level)
    client = {"model": MODEL, "base_url": f"{live_server}/v1", "api_key": admin_key, "max_retries": 0}
    with pytest.raises(openai.BadRequestError) as refused:
        OpenAIEmbeddings(**client).embed_query(TEXTS[0])  # type: ignore[arg-type]
    assert refused.value.code == "token_ids_not_enabled"
    assert "check_embedding_ctx_length=False" in refused.value.message
    text = OpenAIEmbeddings(**client, check_embedding_ctx_length=False).embed_query(TEXTS[0])  # type: ignore[arg-type]
    np.testing.assert_allclose(text, vectors(world.embed(key, input=TEXTS[0]))[0], atol=1e-5, rtol=0)

    with open_live_world(LiveWorld, make_app, tmp_path, models=[ids_entry()]) as live:
        _, ids_key = live.tenant_key()
        taken = OpenAIEmbeddings(model=MODEL, base_url=f"{live.url}/v1", api_key=ids_key,  # type: ignore[arg-type]
                                 max_retries=0).embed_query(TEXTS[0])  # fmt: skip
    as_ids = vectors(ids_world.embed(ids_world.tenant_key()[1], input=list(TEXTS[0].encode())))[0]
    np.testing.assert_allclose(taken, as_ids, atol=1e-5, rtol=0)
    assert not np.allclose(taken, text, atol=1e-2)  # OpenAI-style ids read as SmolLM2's: another text's vector


def test_the_official_client_reads_them(live_server: str, admin_key: str, world: World, key: str) -> None:
    """The openai client asks for base64 unless told otherwise, and decodes it itself."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key=admin_key, max_retries=0, timeout=60)
    answer = client.embeddings.create(model=MODEL, input=TEXTS[:2])
    assert [d.index for d in answer.data] == [0, 1] and answer.usage.prompt_tokens > 0
    np.testing.assert_allclose(np.array([d.embedding for d in answer.data], dtype=np.float32),
                               vectors(world.embed(key, input=TEXTS[:2])), atol=1e-6, rtol=0)  # fmt: skip
    floats = client.embeddings.create(model=MODEL, input="a", encoding_format="float")
    assert len(floats.data[0].embedding) == HIDDEN


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["a", ""]}, "input[1]", None),
        ({"input": [[1, 2], []]}, "input[1]", None),
        ({"input": [[1, 2], [3, "x"]]}, "input[1]", None),
        ({"input": ["a", [1]]}, "input", None),
        ({"input": ["a"] * 2049}, "input", None),
        ({"input": [1] * 8193}, "input", "context_length_exceeded"),  # one over the context
        ({"input": [[1], [1] * 8193]}, "input[1]", "context_length_exceeded"),
        ({"input": [49152]}, "input", None),  # outside the vocabulary
        ({"input": [[5], [-1]]}, "input[1]", None),
        ({"input": 7}, "input", None),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", None),
        ({"input": "a", "dimensions": 8}, "dimensions", "unsupported_parameter"),  # not a Matryoshka model
        ({"input": "a", "dimensions": 0}, "dimensions", None),
        ({"input": "a", "dimensions": "8"}, "dimensions", None),
        ({"input": "a", "user": "u" * 300}, "user", None),
        ({}, "input", None),
        ({"input": "a", "model": ""}, "model", None),
    ],
)
def test_bad_requests_are_openai_shaped_400s_naming_the_parameter(ids_world: World, body: dict[str, Any],
                                                                  param: str, code: str | None) -> None:  # fmt: skip
    """On a model that takes token ids, so that the engine's checks of them answer."""
    _, key = ids_world.tenant_key()
    response = ids_world.client.post("/v1/embeddings", json={"model": MODEL, **body}, headers=bearer(key))
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    if code is not None:
        assert error["code"] == code, error


def test_the_models_own_size_is_a_valid_dimensions(world: World, key: str) -> None:
    assert vectors(world.embed(key, input="a", dimensions=HIDDEN)).shape == (1, HIDDEN)


def test_an_unknown_model_is_404(world: World, key: str) -> None:
    response = world.client.post("/v1/embeddings", json={"model": "nope", "input": "a"}, headers=bearer(key))
    assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"


def test_a_backend_without_embed_says_the_model_serves_no_embeddings(
    served_model: Any, app_for_model: Any, tmp_path: Path
) -> None:
    """A backend may leave the optional ``embed`` out: 400 naming the model, not 404 (it exists) nor 500."""
    from tiny_checkpoints import write_variant

    from inferflux.backends.base import ModelSpec
    from inferflux.backends.cpu import CPUBackend
    from inferflux.backends.engine import AsyncEngine, EngineConfig, LLMEngine
    from inferflux.gateway.models.served import ServedModel

    class WithoutEmbed(CPUBackend):
        embed = None  # type: ignore[assignment]

    backend = WithoutEmbed()
    info = backend.load(ModelSpec("tiny", str(write_variant(tmp_path / "tiny", "llama")), dtype="float32"))
    engine = AsyncEngine(LLMEngine(backend, served_model.tokenizer, info, EngineConfig(num_blocks=8)))
    model = ServedModel(name="tiny", aliases=(), tokenizer=served_model.tokenizer, info=info, engine=engine,
                        backend="cpu")  # fmt: skip
    store = PolicyStore.open(StoreSettings(), tmp_path)
    admin = store.ensure_bootstrap_admin()
    try:
        with TestClient(app_for_model(model, store, data_dir=str(tmp_path / "app"))) as client:
            response = client.post("/v1/embeddings", json={"model": "tiny", "input": "a b"}, headers=bearer(str(admin)))
    finally:
        engine.shutdown(5)
        store.close()
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["param"], error["code"]) == ("model", "model_not_supported")
    assert "does not serve embeddings" in error["message"]


# -- the policy chain --------------------------------------------------------------------------


def test_no_key_is_401(world: World) -> None:
    response = world.client.post("/v1/embeddings", json={"model": MODEL, "input": "a"})
    assert response.status_code == 401 and error_of(response)["code"] == "missing_credentials"


def test_a_model_outside_the_tenants_allow_list_is_404(world: World) -> None:
    _, key = world.tenant_key(allowed_models=["some-other-model"])
    response = world.embed(key, input="a")
    assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"


def test_a_token_quota_is_charged_the_input_tokens_only(world: World) -> None:
    tenant, key = world.tenant_key()
    first = world.embed(key, input=TEXTS[0])
    spent = first.json()["usage"]["total_tokens"]
    world.settled()
    # Room for two more such requests at their real count, not for any completion estimate.
    world.store.create_policy(tenant.id, "quota", "daily", {"scope": "tenant", "period": "day", "tokens": 2 * spent})
    world.policies_seen()
    for _ in range(2):
        assert world.embed(key, input=TEXTS[0]).status_code == 200
        world.settled()
    refused = world.embed(key, input=TEXTS[0])
    assert refused.status_code == 429 and error_of(refused)["code"] == "insufficient_quota"


def test_input_guardrails_block_or_redact_the_inputs(world: World) -> None:
    tenant, key = world.tenant_key()
    world.store.create_policy(tenant.id, "guardrail", "g", {"blocklist": [{"id": "no-ski", "literal": "ski"}],
                                                            "pii": {"email": "redact"}})  # fmt: skip
    world.policies_seen()
    blocked = world.embed(key, input=["fine", "let's go ＳＫＩ"])
    assert blocked.status_code == 400 and error_of(blocked)["code"] == "content_filter"
    # A redacting rule embeds the redacted text: what the model would have seen in a prompt.
    redacted = vectors(world.embed(key, input=["write to bob@example.com"]))
    _, plain_key = world.tenant_key()
    np.testing.assert_allclose(redacted, vectors(world.embed(plain_key, input=["write to [EMAIL]"])), atol=1e-6)
    assert not np.allclose(redacted, vectors(world.embed(plain_key, input=["write to bob@example.com"])), atol=1e-3)


def test_opa_is_told_the_route_and_the_input_tokens(world: World) -> None:
    tenant, key = world.tenant_key()
    rego = (
        "package inferflux.guardrails\n"
        "default decision := {\"allow\": true}\n"
        "decision := {\"allow\": false, \"reasons\": [\"no long embeddings\"]} "
        "if { input.route == \"/v1/embeddings\"; input.tokens.prompt > 5; input.tokens.max_completion == 0 }\n"
    )
    world.store.create_policy(tenant.id, "guardrail", "opa", {"opa": {"engine": "embedded", "rego": rego}})
    world.policies_seen()
    assert world.embed(key, input="short").status_code == 200
    denied = world.embed(key, input="a sentence that is rather longer than five tokens")
    assert denied.status_code == 403 and "no long embeddings" in error_of(denied)["message"]


def test_one_audit_event_with_the_usage_and_no_text(world: World) -> None:
    tenant, key = world.tenant_key()
    ok = world.embed(key, input=["my e-mail is someone@example.com", "second"])
    refused = world.embed(key, input="")
    world.settled()
    events = world.events()
    event = events[ok.headers["x-request-id"]]
    assert (event["decision"], event["status"], event["route"], event["model"]) == ("allow", 200, "POST /v1/embeddings",
                                                                                    MODEL)  # fmt: skip
    assert event["tenant_id"] == tenant.id and event["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert event["completion_tokens"] == 0 and event["prompt_hmac"]
    assert events[refused.headers["x-request-id"]]["status"] == 400
    spool = world.data_dir / "audit" / "segments"
    assert "someone@example.com" not in "".join(s.read_text() for s in spool.glob("*.jsonl"))


# -- a model served by an upstream ---------------------------------------------------------------


def test_a_remote_model_forwards_to_its_upstreams_embeddings(live_server: str, admin_key: str, app_for_model: Any,
                                                             tmp_path: Path, world: World, key: str) -> None:  # fmt: skip
    """The gateway in front of an upstream InferFlux (the session's live server): the same vectors, the
    upstream's own token count, its refusals as the client's 400s, and the audit on the front."""
    from inferflux.backends.base import ModelSpec
    from inferflux.gateway.models.served import load_served_model
    from servers import start_uvicorn, stop_uvicorn
    from upstream_rules import LOOPBACK

    spec = ModelSpec(name="fleet", path="", upstream={"endpoints": [f"{live_server}/v1"], "model": MODEL})
    model = load_served_model(spec, "openai", upstream_key=admin_key, egress=LOOPBACK)
    store = PolicyStore.open(StoreSettings(), tmp_path)
    front_key = str(store.ensure_bootstrap_admin())
    server, thread, sock, url = start_uvicorn(app_for_model(model, store, data_dir=str(tmp_path / "app")))
    try:
        import httpx

        def front(**body: Any) -> Any:
            return httpx.post(f"{url}/v1/embeddings", json={"model": "fleet", **body}, headers=bearer(front_key),
                              timeout=60)  # fmt: skip

        local = world.embed(key, input=TEXTS[:2]).json()
        remote = front(input=TEXTS[:2], encoding_format="base64")
        assert remote.status_code == 200, remote.text
        body = remote.json()
        assert body["model"] == "fleet" and body["usage"] == local["usage"]  # the upstream's count, not the estimate
        for mine, theirs in zip(body["data"], local["data"], strict=True):
            decoded = np.frombuffer(base64.b64decode(mine["embedding"]), dtype="<f4")
            np.testing.assert_array_equal(decoded, np.array(theirs["embedding"], dtype=np.float32))
        refused = front(input="a", dimensions=8)  # the upstream's model is not configured to shorten vectors
        assert refused.status_code == 400 and error_of(refused)["param"] == "dimensions", refused.text
        assert "upstream" in error_of(refused)["message"]
    finally:
        model.shutdown()  # while the server's loop runs: the fleet's connections close in it
        stop_uvicorn(server, thread, sock)
        store.close()
    spool = tmp_path / "app" / "audit" / "segments"
    events = [json.loads(line)["event"] for s in spool.glob("*.jsonl") for line in s.read_text().splitlines()]
    ours = [e for e in events if e.get("request_id") == remote.headers["x-request-id"]]
    assert len(ours) == 1 and ours[0]["prompt_tokens"] == local["usage"]["prompt_tokens"]
