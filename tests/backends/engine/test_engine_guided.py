"""Structured outputs and logit_bias in the engine: the grammar's mask in every row, and nothing else changed.

The model here is scripted: a paged echo backend (every row computed from the
context read back through the block tables) whose logits peak at the next
token of a target text, with small context-dependent noise, and with chosen
"mistakes" (another token) at some positions. The vocabulary is the real
SmolLM2 one (49152 byte-level BPE tokens), so the grammars are compiled for the
vocabulary the server runs.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferflux.backends.engine import (
    EngineConfig,
    GuidedSpec,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
    SamplingParamsError,
    Sequence,
)
from inferflux.backends.engine.guided import bitmask_words
from inferflux.backends.engine.speculative import SpeculativeConfig

from engine_testkit import (
    PagedEchoBackend,
    check_scheduler_invariants,
    echo_logits,
    make_engine,
    model_info,
    smollm2_tokenizer,
)

TOK = smollm2_tokenizer()
VOCAB = 49152
EOS = TOK.eos_token_id
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "pos": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "pos"],
    "additionalProperties": False,
}
JSON_SCHEMA = GuidedSpec("json_schema", schema=SCHEMA)


def scripted(prompt_len: int, target: list[int], mistakes: dict[int, int] | None = None, noise: float = 0.5):
    """A model that wants to write ``target`` then EOS, except ``mistakes`` (output position -> token)."""
    mistakes = mistakes or {}

    def logits(ctx: np.ndarray, vocab: int) -> np.ndarray:
        row = echo_logits(ctx, vocab) * np.float32(noise)
        t = len(ctx) - prompt_len
        row[mistakes.get(t, target[t] if t < len(target) else EOS)] += 20.0
        return row

    return logits


def engine_for(logits_fn, *, num_blocks: int = 512, max_num_seqs: int = 8, speculative=None,
               preemption_mode: str = "recompute", block_size: int = 4) -> LLMEngine:  # fmt: skip
    backend = PagedEchoBackend(vocab=VOCAB, logits_fn=logits_fn)
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=64, speculative=speculative,
                          preemption_mode=preemption_mode)  # fmt: skip
    return LLMEngine(backend, TOK, model_info(VOCAB), config)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    seqs = []
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
        seqs.append(engine._requests[rid])
    got = {rid: {"tokens": [], "text": "", "reason": None} for rid in requests}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return got
        for out in engine.step():
            got[out.request_id]["tokens"] += out.new_token_ids
            got[out.request_id]["text"] += out.new_text
            if out.finished:
                got[out.request_id]["reason"] = out.finish_reason
        check_scheduler_invariants(engine.scheduler, seqs)
    raise AssertionError("the engine did not finish")


def encode(doc: dict) -> list[int]:
    return TOK.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)


def allowed_after(engine: LLMEngine, spec: GuidedSpec, tokens: list[int]) -> np.ndarray:
    """Oracle: which tokens ``spec`` allows after ``tokens`` (a fresh matcher, advanced by hand)."""
    from inferflux.backends.engine.guided import fill_masks

    guide = engine.grammars.compile(spec).guide()
    for t in tokens:
        assert guide.consume(t)
    bitmask = np.zeros((1, bitmask_words(VOCAB)), dtype=np.int32)
    fill_masks([(guide, 0)], (), bitmask)
    return np.unpackbits(bitmask.view(np.uint8), count=VOCAB, bitorder="little").astype(bool)


def in_schema_order(d: dict) -> dict:
    """The grammar emits properties in the schema's order; hypothesis draws keys in any."""
    out = {k: d[k] for k in ("name", "kind", "tags") if k in d}
    out["pos"] = {"x": d["pos"]["x"], "ok": d["pos"]["ok"]}
    return out


DOCS = st.fixed_dictionaries(
    {
        "name": st.text(alphabet="abcxyz ", max_size=8),
        "kind": st.sampled_from(["cat", "dog", "bird"]),
        "pos": st.fixed_dictionaries({"x": st.integers(0, 999), "ok": st.booleans()}),
    },
    optional={"tags": st.lists(st.sampled_from(["a", "bb", "ccc"]), max_size=3)},
).map(in_schema_order)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=DOCS, mistakes=st.dictionaries(st.integers(0, 30), st.integers(0, VOCAB - 1), max_size=4),
       prompt=st.lists(st.integers(3, 5000), min_size=1, max_size=6))  # fmt: skip
def test_greedy_output_is_the_models_wherever_the_grammar_allows_it(doc, mistakes, prompt) -> None:
    """Each guided greedy token is the model's own argmax when the grammar allows it, else the best
    token the grammar allows; with no mistakes the model's valid text comes out unchanged."""
    target = encode(doc)
    fn = scripted(len(prompt), target, mistakes)
    engine = engine_for(fn)
    guided = SamplingParams(temperature=0.0, max_tokens=120, guided=JSON_SCHEMA)
    free = SamplingParams(temperature=0.0, max_tokens=len(target) + 1)
    got = run(engine, {"guided": (prompt, guided), "free": (prompt, free)})
    out = got["guided"]["tokens"]
    for t, token in enumerate(out):
        row = fn(np.asarray(prompt + out[:t]), VOCAB)
        allowed = allowed_after(engine, JSON_SCHEMA, out[:t])
        best = int(row.argmax())
        if allowed[best]:
            assert token == best, f"step {t}: the grammar allowed the model's {best} but {token} came out"
        else:
            assert token == int(np.where(allowed, row, -np.inf).argmax()), f"step {t}"
    assert got["guided"]["reason"] == "stop" and out[-1] in TOK.eos_token_ids
    jsonschema.validate(json.loads(got["guided"]["text"]), SCHEMA)
    if not mistakes:
        assert out == got["free"]["tokens"] == target + [EOS]


def test_sampled_outputs_parse_and_validate() -> None:
    """Temperature 1 over a noisy model: every output is valid and ends by itself."""
    target = encode({"name": "abc", "kind": "dog", "pos": {"x": 12, "ok": True}})
    engine = engine_for(scripted(3, target, noise=3.0), max_num_seqs=16)
    requests = {f"r{i}": ([7, i + 10, 9], SamplingParams(temperature=1.0, seed=i, max_tokens=200, guided=JSON_SCHEMA))
                for i in range(16)}  # fmt: skip
    got = run(engine, requests)
    for r in got.values():
        assert r["reason"] == "stop"
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
    assert len({r["text"] for r in got.values()}) > 1  # the noise did change choices


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_keep_their_grammar_state(mode: str) -> None:
    """With a KV cache too small for the batch, sequences are preempted (recomputed, or swapped
    out and back) mid-output; each ends as it does alone, valid."""
    target = encode({"name": "preempt me", "kind": "bird", "tags": ["a", "bb"], "pos": {"x": 998, "ok": False}})
    requests = {}
    for i in range(8):
        prompt = [100 + i, 200 + i, 300, 400 + i]
        mistakes = {3 + i: 30 + i, 12: 5000 + i}
        requests[f"r{i}"] = (prompt, SamplingParams(temperature=0.0, max_tokens=120, guided=JSON_SCHEMA), mistakes)

    def fn_for(prompt, mistakes):
        return scripted(len(prompt), target, mistakes)

    alone = {}
    for rid, (prompt, params, mistakes) in requests.items():
        alone[rid] = run(engine_for(fn_for(prompt, mistakes)), {rid: (prompt, params)})[rid]

    # One engine for all: the model must tell sequences apart, so it reads the prompt's first token.
    by_first = {prompt[0]: (prompt, mistakes) for prompt, _, mistakes in requests.values()}

    def shared(ctx: np.ndarray, vocab: int) -> np.ndarray:
        prompt, mistakes = by_first[int(ctx[0])]
        return fn_for(prompt, mistakes)(ctx, vocab)

    engine = engine_for(shared, num_blocks=40, preemption_mode=mode)
    got = run(engine, {rid: (p, params) for rid, (p, params, _) in requests.items()})
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.scheduler.num_swap_outs > 0
    for rid, r in got.items():
        assert r["tokens"] == alone[rid]["tokens"], rid
        assert r["reason"] == "stop"
        jsonschema.validate(json.loads(r["text"]), SCHEMA)


def test_the_first_token_after_a_chunked_prefill_obeys_the_grammar() -> None:
    """A prompt of 150 tokens prefilled in chunks of at most 64: the row of its last chunk is
    masked like a decode row, so a model that would open with prose still opens the JSON."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(100, 40000, size=150)]
    target = encode({"name": "chunked", "kind": "cat", "pos": {"x": 1, "ok": True}})
    prose = TOK.encode("Sure", add_special_tokens=False)[0]
    engine = engine_for(scripted(len(prompt), target, {0: prose}))
    got = run(engine, {"r": (prompt, SamplingParams(temperature=0.0, max_tokens=80, guided=JSON_SCHEMA))})["r"]
    assert len({len(b.slices[0].token_ids) for b in engine.backend.batches[:3]}) > 1  # it was chunked
    assert got["tokens"][0] != prose and got["reason"] == "stop"
    jsonschema.validate(json.loads(got["text"]), SCHEMA)


ITEMS_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}  # fmt: skip


def test_ngram_speculation_gives_the_same_guided_tokens() -> None:
    """Prompt-lookup drafts (which copy the repeated items) are verified against the grammar's
    masks: the model wants a fifth item the grammar (maxItems 3) refuses, and the drafts propose
    it too; the tokens are those of plain guided decoding."""
    spec = GuidedSpec("json_schema", schema=ITEMS_SCHEMA)
    target = encode({"items": [{"id": 7, "ok": True}] * 5})
    prompt = [11, 12, 13]
    params = SamplingParams(temperature=0.0, max_tokens=150, guided=spec)
    plain = run(engine_for(scripted(len(prompt), target)), {"r": (prompt, params)})["r"]
    engine = engine_for(scripted(len(prompt), target), speculative=SpeculativeConfig(method="ngram", k=4))
    spec_out = run(engine, {"r": (prompt, params)})["r"]
    assert spec_out["tokens"] == plain["tokens"]
    assert json.loads(spec_out["text"]) == {"items": [{"id": 7, "ok": True}] * 3}
    assert engine.speculator.num_accepted > 0
    assert engine.speculator.num_proposed > engine.speculator.num_accepted  # some drafts were refused


def test_a_draft_token_the_grammar_refuses_is_rejected_and_leaves_the_matcher_alone() -> None:
    engine = engine_for(scripted(1, []))
    choice = GuidedSpec("choice", choices=("yes", "no"))
    request = engine.make_request("r", [5], SamplingParams(temperature=0.0, guided=choice))
    seq = Sequence(0, "r", [5], request.params, max_tokens=10)
    seq.guide = request.grammar.guide()
    yes = TOK.encode("yes", add_special_tokens=False)
    bad = TOK.encode("{", add_special_tokens=False)[0]
    draft = [yes[0], bad]
    masks = engine.sampler.draft_masks(seq, draft, VOCAB)
    rows = np.zeros((3, VOCAB), dtype=np.float32)
    rows[0, draft[0]] = rows[1, draft[1]] = 10.0  # the model agrees with the whole draft
    first, took = engine.sampler.verify_row(rows[0], seq, draft[0], masks[0])
    assert took and first.token_id == draft[0]
    second, took = engine.sampler.verify_row(rows[1], seq, draft[1], masks[1])
    assert not took and second.token_id != bad
    # draft_masks advanced nothing: the matcher still takes "yes" from the start
    assert all(seq.guide.consume(t) for t in yes) and seq.guide.is_accepting


def test_unsupported_schema_is_refused_naming_the_construct() -> None:
    engine = engine_for(scripted(1, []))
    schema = {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}
    with pytest.raises(InvalidRequestError) as caught:
        engine.make_request("r", [5], SamplingParams(guided=GuidedSpec("json_schema", schema=schema)))
    assert caught.value.param == "guided"
    assert '"if"' in str(caught.value) and "<state>" not in str(caught.value)
    with pytest.raises(InvalidRequestError, match="look-around"):
        engine.make_request("r", [5], SamplingParams(guided=GuidedSpec("regex", pattern="(?=a)a")))
    with pytest.raises(SamplingParamsError):
        engine.make_request("r", [5], SamplingParams(guided=GuidedSpec("choice", choices=())))


def test_compiled_grammars_are_cached_by_content() -> None:
    engine = engine_for(scripted(1, []))
    reordered = json.loads(json.dumps(SCHEMA, sort_keys=True))
    first = engine.make_request("a", [5], SamplingParams(guided=JSON_SCHEMA))
    second = engine.make_request("b", [5], SamplingParams(guided=GuidedSpec("json_schema", schema=reordered)))
    assert first.grammar is second.grammar and engine.grammars.num_compiled == 1


def test_regex_choice_and_json_object() -> None:
    engine = engine_for(scripted(2, [], noise=4.0), max_num_seqs=16)
    kinds = {
        "regex": GuidedSpec("regex", pattern=r"[0-9]{3}-[a-z]{2}"),
        "choice": GuidedSpec("choice", choices=("red", "green", "blue sky")),
        "object": GuidedSpec("json_object"),
    }
    requests = {f"{kind}{i}": ([3, i + 4], SamplingParams(temperature=1.0, seed=i, max_tokens=60, guided=spec))
                for kind, spec in kinds.items() for i in range(4)}  # fmt: skip
    got = run(engine, requests)
    for rid, r in got.items():
        if rid.startswith("regex"):
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r["text"]), r
        elif rid.startswith("choice"):
            assert r["text"] in ("red", "green", "blue sky"), r
        elif r["reason"] == "stop":  # json_object is unbounded: a long random object may run out of tokens
            assert isinstance(json.loads(r["text"]), dict), r
    assert all(r["reason"] == "stop" for rid, r in got.items() if not rid.startswith("object"))


def test_a_complete_grammar_ends_the_output_despite_min_tokens() -> None:
    engine = engine_for(scripted(2, [], noise=1.0))
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20, guided=GuidedSpec("choice", choices=("ok",)))
    got = run(engine, {"r": ([3, 4], params)})["r"]
    assert got["text"] == "ok" and got["reason"] == "stop"


# -- logit_bias ------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plus_100_makes_every_token_that_token(temperature: float) -> None:
    engine, _ = make_engine()
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=40, logit_bias={17: 100.0})
    assert run(engine, {"r": ([1, 2, 3], params)})["r"]["tokens"] == [17] * 40


def test_minus_100_bans_the_models_choice() -> None:
    engine, _ = make_engine()
    free = run(engine, {"free": ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1))})["free"]["tokens"][0]
    engine, _ = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=30, logit_bias={free: -100.0})
    got = run(engine, {"r": ([1, 2, 3], params)})["r"]["tokens"]
    assert free not in got and got


def test_bias_never_lifts_a_token_the_grammar_refuses() -> None:
    engine = engine_for(scripted(1, [], noise=1.0))
    brace = TOK.encode("{", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={brace: 100.0},
                            guided=GuidedSpec("choice", choices=("no",)))  # fmt: skip
    assert run(engine, {"r": ([3], params)})["r"]["text"] == "no"


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({VOCAB: 1.0}, "not a token id"),
        ({-1: 1.0}, "not a token id"),
        ({i: 1.0 for i in range(301)}, "at most 300"),
        ({5: 100.5}, r"logit_bias\[5\] must be in \[-100, 100\]"),
        ({5: float("inf")}, "finite"),
        ({"5": 1.0}, "not a token id"),
    ],
)
def test_bad_logit_bias_is_refused(bias: dict, message: str) -> None:
    engine = engine_for(scripted(1, []))
    with pytest.raises(SamplingParamsError, match=message) as caught:
        engine.make_request("r", [5], SamplingParams(logit_bias=bias))
    assert caught.value.param == "logit_bias"


# -- json_object within max_tokens ---------------------------------------------------------------

# Strings of one-, two-, three- and four-byte characters and of characters JSON escapes.
JSON_TEXT = st.text(alphabet=st.sampled_from('ab "\\/\n\t\x01é中😀'), max_size=6)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | JSON_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(JSON_TEXT, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.dictionaries(JSON_TEXT, JSON_VALUES, max_size=4))
def test_the_closing_text_completes_every_prefix_and_the_grammar_takes_it(doc) -> None:
    """After every token of a JSON object, the closer's text is a valid ending the grammar allows,
    byte by byte, and it grows by at most JSON_CLOSE_GROWTH per byte written."""
    from inferflux.backends.engine.json_closer import JSON_CLOSE_GROWTH

    engine = engine_for(scripted(1, []))
    compiled = engine.grammars.compile(GuidedSpec("json_object"))
    vocabulary = compiled._vocabulary
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    guide = compiled.guide()
    written = b""
    before = len(guide.closer.closing())
    for token in TOK.encode(text, add_special_tokens=False):
        assert guide.consume(token)
        piece = vocabulary.text[token]
        written += piece
        closing = guide.closer.closing()
        assert len(closing) <= before + JSON_CLOSE_GROWTH * len(piece)
        before = len(closing)
        ending = guide.matcher.deep_copy()
        assert all(ending.consume_token(vocabulary.byte_token[b]) for b in closing), (written, closing)
        assert ending.is_accepting(), (written, closing)
        assert isinstance(json.loads((written + closing).decode("utf-8")), dict)
    assert guide.closer.closing() == b""


def test_a_json_object_always_closes_within_max_tokens() -> None:
    """A model that would write one endless string, and a noisy one at temperature 1: every answer
    parses within max_tokens; those the budget cut end with finish_reason "length"."""
    endless = TOK.encode('{"story":"' + "once upon a time " * 40, add_special_tokens=False)
    engine = engine_for(scripted(2, endless), max_num_seqs=16)
    requests = {f"endless{m}": ([3, m], SamplingParams(temperature=0.0, max_tokens=m, guided=GuidedSpec("json_object")))
                for m in (3, 4, 9, 30, 64)}  # fmt: skip
    # Literals: where the grammar forces "alse" after "f", its mask offers that one token only.
    falses = TOK.encode('{"a":[' + "false," * 40, add_special_tokens=False)
    literal_requests = {f"false{m}": ([4, m], SamplingParams(temperature=0.0, max_tokens=m,
                                                             guided=GuidedSpec("json_object")))
                        for m in range(8, 40)}  # fmt: skip
    requests.update(literal_requests)
    noisy = engine_for(scripted(2, [], noise=4.0), max_num_seqs=16)
    sampled = {f"noisy{i}": ([3, i + 4], SamplingParams(temperature=1.0, seed=i, max_tokens=8 + 3 * i,
                                                         guided=GuidedSpec("json_object")))
               for i in range(12)}  # fmt: skip
    got = {**run(engine, {k: v for k, v in requests.items() if k.startswith("endless")}),
           **run(engine_for(scripted(2, falses), max_num_seqs=32), literal_requests), **run(noisy, sampled)}
    for rid, r in got.items():
        assert isinstance(json.loads(r["text"]), dict), (rid, r)
        limit = requests.get(rid, sampled.get(rid))[1].max_tokens
        assert len(r["tokens"]) <= limit
    assert all(got[f"endless{m}"]["reason"] == "length" for m in (3, 4, 9, 30, 64))
    assert got["endless64"]["text"].startswith('{"story":"once upon a time')
