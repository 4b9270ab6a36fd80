"""Deterministic mode (issue 22, point 5): in bfloat16, a greedy request's tokens and
logprobs are the same bits alone and inside a crowded engine, where other tenants'
requests share its batches, its prompt is prefilled in chunks, it is preempted and
recomputed, and n-gram speculation verifies drafts. Each of those is checked to have
happened, so a run that dodged them cannot pass by accident."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from inferflux.backends.base import ModelSpec
from inferflux.backends.cpu import CPUBackend
from inferflux.backends.engine import EngineConfig, LLMEngine, SamplingParams
from inferflux.backends.engine.speculative import SpeculativeConfig
from inferflux.backends.models import default_model_path, open_model
from inferflux.kernels import cpu as cpu_kernels
from greedy_runs import reference_prompts

pytestmark = pytest.mark.model

MAX_TOKENS = 12
# The tokens and logprobs of one request: what must not move.
Trace = list[tuple[int, float, tuple[tuple[int, float], ...]]]


def trace_of(outputs: list[Any]) -> Trace:
    """A request's generated tokens with their logprobs and top alternatives, as plain values."""
    return [(lp.token_id, lp.logprob, tuple((t, p) for t, _, p in lp.top)) for o in outputs for lp in o.logprobs or ()]


def first_difference(a: Trace, b: Trace) -> str | None:
    """Where two traces part (bitwise: a logprob one ulp off counts), or None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i}: {x} != {y}"
    return None if len(a) == len(b) else f"lengths {len(a)} != {len(b)}"


def test_first_difference_sees_one_ulp_and_a_token():
    import numpy as np

    base: Trace = [(5, -0.25, ((5, -0.25), (7, -1.5))), (9, -0.125, ((9, -0.125), (2, -3.0)))]
    assert first_difference(base, list(base)) is None
    ulp = float(np.nextafter(np.float32(-0.125), np.float32(0)))
    assert first_difference(base, [base[0], (9, ulp, base[1][2])]) is not None
    assert first_difference(base, [base[0], (2, -0.125, base[1][2])]) is not None
    assert first_difference(base, [base[0], (9, -0.125, ((9, -0.125), (3, -3.0)))]) is not None
    assert first_difference(base, base[:1]) is not None


def _exact_where_it_builds(dtype: torch.dtype, mode: str = "exact") -> Any:
    need = "AVX-512 BF16" if dtype == torch.bfloat16 else "the C++ kernels"
    name = str(dtype).removeprefix("torch.")
    return pytest.param((mode, name), id=f"{mode}-{name}", marks=pytest.mark.skipif(
        not (cpu_kernels.load() is not None and cpu_kernels.exact_linear_supported(dtype)),
        reason=f"exact_linear on {name} rows needs {need}, which this CPU lacks"))


# The file's own Q4_1 blocks through the quantised kernel, dense bfloat16 weights through
# invariant_linear, and both (exact: the blocks below gemm_from, the dense weights from there,
# the same bits; in bfloat16, and in float32 as a CPU without BF16 loads it), and the blocks alone
# (blocks: exact_linear at every size, auto's choice below AVX-512): the kinds of projection a
# deterministic model may run.
@pytest.fixture(scope="module", params=[
    pytest.param(("native", "bfloat16"), id="native"), pytest.param(("bf16", "bfloat16"), id="bf16"),
    _exact_where_it_builds(torch.bfloat16), _exact_where_it_builds(torch.float32),
    _exact_where_it_builds(torch.float32, "blocks"),
])  # fmt: skip
def model(request: pytest.FixtureRequest) -> tuple[CPUBackend, Any, Any]:
    mode, dtype = request.param
    spec = ModelSpec(name="smol", path=default_model_path(), dtype=dtype, deterministic=True,
                     passes={"quantise": mode})
    backend = CPUBackend()
    info = backend.load(spec)
    assert info.deterministic and info.dtype == dtype
    return backend, info, open_model(default_model_path()).tokenizer()


def _run(model: tuple[CPUBackend, Any, Any], requests: dict[str, list[int]], config: EngineConfig,
         stagger: int) -> tuple[dict[str, list[Any]], Any]:
    backend, info, tokenizer = model
    engine = LLMEngine(backend, tokenizer, info, config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    outputs: dict[str, list[Any]] = {rid: [] for rid in requests}
    pending, steps = list(requests.items()), 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % stagger == 0:
            rid, ids = pending.pop(0)
            engine.add_request(rid, ids, params)
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
    return outputs, engine.stats()


def test_greedy_tokens_and_logprobs_do_not_depend_on_the_batch(model):
    tokenizer = model[2]
    chat, _, _, raw = reference_prompts(tokenizer)
    # A prompt that repeats itself, so n-gram drafts exist from the first steps.
    prompts = [chat, raw, tokenizer.encode("one two three four, one two three four, one two three four, one two")]
    mine = {f"mine-{i}": ids for i, ids in enumerate(prompts)}
    others = {f"other-{i}": tokenizer.encode(text) for i, text in enumerate(
        ["The weather today is", "Dear tenant, your invoice", "1, 1, 2, 3, 5, 8,"])}

    alone = {}
    for rid, ids in mine.items():
        outputs, _ = _run(model, {rid: ids}, EngineConfig(num_blocks=256, max_num_batched_tokens=2048, max_num_seqs=1),
                          stagger=1)
        alone[rid] = trace_of(outputs[rid])
        assert len(alone[rid]) == MAX_TOKENS

    # Interleaved with the other tenants' requests, one a step; prefill chunks of 16 tokens; a KV
    # cache of 20 blocks of 4 tokens, which holds the largest request but not all of them (they
    # need about 47), so decodes preempt; n-gram speculation. The blocks are smaller than alone.
    crowd = dict(item for pair in zip(mine.items(), others.items()) for item in pair)
    config = EngineConfig(block_size=4, num_blocks=20, max_num_seqs=8, max_num_batched_tokens=16,
                          speculative=SpeculativeConfig(method="ngram", k=3, max_batch=8))
    outputs, stats = _run(model, crowd, config, stagger=1)
    assert stats.num_preemptions > 0, "the run must preempt (and recompute) a sequence"
    assert stats.spec_proposed_tokens > 0, "the run must verify speculative drafts"
    assert any(len(ids) > 16 for ids in mine.values()), "a prompt must be prefilled in several chunks"
    for rid in mine:
        assert first_difference(alone[rid], trace_of(outputs[rid])) is None, rid


def test_without_the_cpp_kernels_deterministic_mode_refuses_to_load(monkeypatch):
    from inferflux.backends.base import BackendError

    monkeypatch.setattr(CPUBackend, "_use_kernels", staticmethod(lambda model: "disabled by INFERFLUX_CPU_KERNELS"))
    spec = ModelSpec(name="smol", path=default_model_path(), dtype="bfloat16", deterministic=True)
    with pytest.raises(BackendError, match="needs the C\\+\\+ CPU kernels.*INFERFLUX_CPU_KERNELS"):
        CPUBackend().load(spec)
