"""The completions route's ``echo`` with ``logprobs``, ``best_of`` and ``suffix``, and ``user`` on every route.

On the real session model (float32): echoed prompt logprobs are transformers' log_softmax of
the same tokens within 1e-3, the first null; ``best_of`` returns the candidates with the highest
mean logprob (the same seeded candidates ``n`` returns), counts every candidate in the usage
and reserves for all of them; ``suffix`` is refused for SmolLM2 (no fill-in-the-middle tokens)
and builds the PSM prompt for a tokenizer that has them; ``user`` reaches the audit event
(cut, credentials redacted) and OPA's input. A remote model passes ``user`` and ``suffix``
upstream, and ``best_of`` for a single choice (above ``n`` with several: refused).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from inferflux.gateway.errors import UnsupportedParameter
from inferflux.gateway.pipeline.completions import FIM_TOKENS, fim_prompt, keep_best, mean_logprob
from inferflux.gateway.pipeline.plan import encode_prompts
from inferflux.gateway.pipeline.protocol import CompletionRequest
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from app_world import AppWorld, open_world
from http_helpers import bearer, error_of

MODEL = DEFAULT_MODEL_NAME
POLL = 0.05
PROMPT = "The capital of France is Paris. The capital of Italy is"


class World(AppWorld):
    tenant_prefix = "c"

    def post(self, key: str, path: str, **body: Any) -> Any:
        return self.client.post(path, json={"model": MODEL, **body}, headers=bearer(key))

    def complete(self, key: str, **body: Any) -> Any:
        return self.post(key, "/v1/completions", **body)

    def events(self) -> dict[str, dict[str, Any]]:
        self.settled()
        segments = sorted((self.data_dir / "audit" / "segments").glob("*.jsonl"))
        return {e["event"]["request_id"]: e["event"] for s in segments for line in s.read_text().splitlines()
                if (e := json.loads(line))}  # fmt: skip


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir = tmp_path_factory.mktemp("completions")
    with open_world(World, make_app, data_dir, auth={"revocation_poll_seconds": POLL}) as world:
        yield world


@pytest.fixture(scope="module")
def key(world: World) -> str:
    return world.tenant_key()[1]


@pytest.fixture(scope="module")
def log_softmax(hf_smollm2: Any) -> Any:
    """``log_softmax(ids)``: transformers' float32 log-softmax at every position of ``ids``."""
    import torch

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1).numpy()

    return run


def ok(response: Any) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


# -- echo with logprobs ------------------------------------------------------------------------


def test_echo_with_logprobs_gives_the_prompts_logprobs_first(world: World, key: str, served_model: Any,
                                                              log_softmax: Any) -> None:  # fmt: skip
    ids = served_model.tokenizer.encode(PROMPT)
    body = ok(world.complete(key, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0))
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(ids) + body["usage"]["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][: len(ids)]) == PROMPT
    want = log_softmax(ids)
    theirs = want[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(lp["token_logprobs"][1 : len(ids)], theirs, atol=1e-3, rtol=0)
    for pos in range(1, len(ids)):
        best = max(lp["top_logprobs"][pos].values())
        assert len(lp["top_logprobs"][pos]) == 2 and best == pytest.approx(float(want[pos - 1].max()), abs=1e-3)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert lp["text_offset"][len(ids)] == len(PROMPT)  # the completion's tokens continue after the prompt
    # the completion's part is what the same request without echo gets
    plain = ok(world.complete(key, prompt=PROMPT, logprobs=2, max_tokens=4, temperature=0))["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    assert lp["tokens"][len(ids) :] == plain["logprobs"]["tokens"]
    np.testing.assert_allclose(lp["token_logprobs"][len(ids) :], plain["logprobs"]["token_logprobs"], atol=1e-5)
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_echo_with_logprobs_streams_the_prompt_with_the_first_chunk(world: World, key: str) -> None:
    whole = ok(world.complete(key, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0))["choices"][0]
    with world.client.stream("POST", "/v1/completions", headers=bearer(key), json={
            "model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0,
            "stream": True}) as response:  # fmt: skip
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    values = [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    assert values[0] is None and np.allclose(values[1:], whole["logprobs"]["token_logprobs"][1:], atol=1e-5)


def test_echo_without_logprobs_and_several_prompts_still_work(world: World, key: str) -> None:
    body = ok(world.complete(key, prompt=["Hello", "Goodbye"], echo=True, logprobs=0, max_tokens=2, n=2))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"][:5] for c in body["choices"]] == ["Hello", "Hello", "Goodb", "Goodb"]
    assert all(c["logprobs"]["token_logprobs"][0] is None for c in body["choices"])


# -- best_of ------------------------------------------------------------------------------------


def test_best_of_returns_the_candidates_with_the_highest_mean_logprob(world: World, key: str) -> None:
    common = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 11}
    candidates = ok(world.complete(key, n=4, logprobs=0, **common))
    means = [np.mean(c["logprobs"]["token_logprobs"]) for c in candidates["choices"]]
    order = sorted(range(4), key=lambda i: (-means[i], i))
    best = ok(world.complete(key, n=2, best_of=4, **common))
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [c["text"] for c in best["choices"]] == [candidates["choices"][i]["text"] for i in order[:2]]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for
    # usage counts every candidate generated; the prompt once
    assert best["usage"] == candidates["usage"]
    one = ok(world.complete(key, best_of=4, logprobs=1, **common))
    assert len(one["choices"]) == 1 and one["choices"][0]["text"] == candidates["choices"][order[0]]["text"]
    assert len(one["choices"][0]["logprobs"]["tokens"]) == len(candidates["choices"][order[0]]["logprobs"]["tokens"])


def test_best_of_reserves_for_every_candidate(world: World) -> None:
    tenant, key = world.tenant_key()
    # one candidate reserves its prompt token and 8 completion tokens (9 of 20); best_of 4 reserves 4 x 9
    world.store.create_policy(tenant.id, "quota", "daily", {"scope": "tenant", "period": "day", "tokens": 20})
    time.sleep(3 * POLL)
    refused = world.complete(key, prompt="Hi", max_tokens=8, best_of=4)
    assert refused.status_code == 429, refused.text
    assert world.complete(key, prompt="Hi", max_tokens=8).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 17}, "best_of"),
    ({"prompt": ["a", "b", "c"], "best_of": 6}, "best_of"),
])  # fmt: skip
def test_bad_best_of_is_a_400_naming_it(world: World, key: str, body: dict[str, Any], param: str) -> None:
    response = world.complete(key, **{"prompt": "Hi", "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_best_of_equal_to_n_streams(world: World, key: str) -> None:
    with world.client.stream("POST", "/v1/completions", headers=bearer(key), json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2, "best_of": 2, "stream": True}) as response:
        assert response.status_code == 200


def test_keep_best_ranks_by_mean_logprob_per_token() -> None:
    def out(*logprobs: float) -> Any:
        return SimpleNamespace(logprobs=[SimpleNamespace(logprob=v) for v in logprobs])

    choices = [SimpleNamespace(index=i, prompt_index=i // 3) for i in range(6)]
    outputs = {0: [out(-1.0, -1.0)], 1: [out(-0.5), out(-0.7)], 2: [], 3: [out(-3.0)], 4: [out(-2.0, -0.1)],
               5: [out(float("nan"))]}  # fmt: skip
    assert mean_logprob(outputs[2]) == -np.inf and mean_logprob(outputs[5]) == -np.inf
    kept = keep_best(choices, outputs, 2)  # type: ignore[arg-type]
    assert [(answer, index) for answer, index, _ in kept] == [(0, 1), (1, 0), (2, 4), (3, 3)]


# -- suffix --------------------------------------------------------------------------------------


def test_suffix_is_refused_for_a_model_without_fill_in_the_middle_tokens(world: World, key: str) -> None:
    response = world.complete(key, prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))", max_tokens=4)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["param"], error["code"]) == ("suffix", "unsupported_parameter")
    assert "fill-in-the-middle" in error["message"] and MODEL in error["message"]
    assert world.complete(key, prompt="Hi", suffix="", max_tokens=2).status_code == 200  # empty: no suffix
    echoed = world.complete(key, prompt="Hi", suffix="end", echo=True, max_tokens=2)
    assert echoed.status_code == 400 and error_of(echoed)["param"] == "echo"


def fim_tokenizer(names: tuple[str, str, str], bos: bool = False) -> Any:
    """A tiny word-level tokenizer with the fill-in-the-middle tokens ``names`` as special tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    from inferflux.backends.models.tokenizer import Tokenizer

    words = ["<s>", "</s>", "[UNK]", "def", "add", "(", ")", "return", "print", *names]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>", *names])
    if bos:
        backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return Tokenizer(backend, bos_token_id=0, eos_token_id=1)


@pytest.mark.parametrize("names", FIM_TOKENS)
def test_suffix_builds_the_prefix_suffix_middle_prompt(names: tuple[str, str, str]) -> None:
    tok = fim_tokenizer(names)
    pre, suf, mid = (tok.token_to_id(n) for n in names)
    ids = fim_prompt(tok, "m", "def add ( )", "print ( )")
    assert ids == [pre, *tok.encode("def add ( )", add_special_tokens=False), suf,
                   *tok.encode("print ( )", add_special_tokens=False), mid]  # fmt: skip
    assert fim_prompt(tok, "m", [3, 4], "return") == [pre, 3, 4, suf, tok.token_to_id("return"), mid]
    assert fim_prompt(fim_tokenizer(names, bos=True), "m", "def", "add")[0] == 0  # BOS first where the model adds it


def test_a_served_prompt_with_a_suffix_is_the_fim_prompt() -> None:
    tok = fim_tokenizer(FIM_TOKENS[1])
    served = SimpleNamespace(name="coder", local_tokenizer=tok)
    req = CompletionRequest.model_validate({"model": "coder", "prompt": ["def add", "print"], "suffix": "return"})
    prompts = encode_prompts(served, req)  # type: ignore[arg-type]
    assert [p.token_ids for p in prompts] == [fim_prompt(tok, "coder", "def add", "return"),
                                             fim_prompt(tok, "coder", "print", "return")]  # fmt: skip
    bare = SimpleNamespace(name="smol", local_tokenizer=SimpleNamespace(
        token_to_id=lambda _: None, bos_token_id=None, add_bos_token=False, encode=tok.encode))  # fmt: skip
    with pytest.raises(UnsupportedParameter) as refused:
        encode_prompts(bare, req)  # type: ignore[arg-type]
    assert refused.value.param == "suffix"


# -- user ----------------------------------------------------------------------------------------


def test_user_reaches_the_audit_event_on_every_route(world: World, key: str) -> None:
    secret = "ifx_" + "a" * 12 + "_" + "B" * 43  # shaped like one of our API keys
    calls = {
        "chat": world.post(key, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                           user="end-user-42"),
        "completions": world.complete(key, prompt="Hi", max_tokens=2, user="end-user-43"),
        "embeddings": world.post(key, "/v1/embeddings", input="Hi", user="end-user-44"),
        "long": world.complete(key, prompt="Hi", max_tokens=2, user="u" * 256),
        "secret": world.complete(key, prompt="Hi", max_tokens=2, user=f"token {secret}"),
        "none": world.complete(key, prompt="Hi", max_tokens=2),
    }
    for name, response in calls.items():
        assert response.status_code == 200, (name, response.text)
    events = world.events()
    user = {name: events[r.headers["x-request-id"]]["user"] for name, r in calls.items()}
    assert (user["chat"], user["completions"], user["embeddings"]) == ("end-user-42", "end-user-43", "end-user-44")
    assert user["long"] == "u" * 128
    assert secret not in user["secret"] and user["secret"].startswith("token ifx_aaaaaaaaaaaa_[REDACTED]")
    assert user["none"] is None


def test_opa_sees_the_user(world: World) -> None:
    tenant, key = world.tenant_key()
    rego = ("package inferflux.guardrails\n"
            "default decision := {\"allow\": true}\n"
            "decision := {\"allow\": false, \"reasons\": [\"user blocked\"]} "
            "if { input.user == \"mallory\" }\n")  # fmt: skip
    world.store.create_policy(tenant.id, "guardrail", "opa", {"opa": {"engine": "embedded", "rego": rego}})
    time.sleep(3 * POLL)
    assert world.complete(key, prompt="Hi", max_tokens=2, user="alice").status_code == 200
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}), ("/v1/embeddings", {"input": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})):
        denied = world.post(key, path, user="mallory", **body)
        assert denied.status_code == 403 and "user blocked" in error_of(denied)["message"], path


# -- a model served by an upstream ---------------------------------------------------------------


def test_a_remote_model_passes_user_suffix_and_best_of_upstream(fleet_model: Any) -> None:
    from inferflux.gateway.pipeline.plan import Placement
    from inferflux.gateway.pipeline.plan_remote import plan_remote
    from inferflux.gateway.pipeline.protocol import ChatCompletionRequest

    req = CompletionRequest.model_validate({"model": "fleet", "prompt": "def f(", "suffix": ")", "user": "u1",
                                            "n": 2, "best_of": 2, "max_tokens": 5})  # fmt: skip
    plan = plan_remote(fleet_model, req, Placement())
    bodies = [c.request.body for c in plan.choices]  # type: ignore[union-attr]
    assert [(b["suffix"], b["user"], "best_of" in b) for b in bodies] == [(")", "u1", False)] * 2
    assert plan.requested_completion_tokens == 10
    chat = ChatCompletionRequest.model_validate({"model": "fleet", "messages": [{"role": "user", "content": "x"}],
                                                 "user": "u2"})  # fmt: skip
    chat_body = plan_remote(fleet_model, chat, Placement()).choices[0].request.body  # type: ignore[union-attr]
    assert chat_body["user"] == "u2"
    # one choice: best_of goes upstream (asked whole, never streamed), and the limits reserve every candidate
    best = plan_remote(fleet_model, CompletionRequest.model_validate(
        {"model": "fleet", "prompt": "x", "best_of": 3, "max_tokens": 5}), Placement())  # fmt: skip
    assert [c.request.body["best_of"] for c in best.choices] == [3]  # type: ignore[union-attr]
    assert not best.choices[0].request.stream and best.requested_completion_tokens == 15  # type: ignore[union-attr]
    # several: each choice is its own upstream request, which cannot rank across them
    with pytest.raises(UnsupportedParameter) as refused:
        plan_remote(fleet_model, CompletionRequest.model_validate({"model": "fleet", "prompt": "x", "n": 2,
                                                                   "best_of": 4}), Placement())  # fmt: skip
    assert refused.value.param == "best_of"
