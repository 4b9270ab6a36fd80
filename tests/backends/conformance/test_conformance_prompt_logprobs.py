"""Prompt logprobs through the real engine on every backend: each prompt token's logprob equals
transformers' log_softmax of the same float32 model's logits within 1e-3, with the prompt cut
into prefill chunks by a small step budget and beside a request that wants none."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from conformance_kit import BLOCK

from inferflux.backends.engine import EngineConfig, LLMEngine, SamplingParams

ATOL = 1e-3
TOP = 5


def transformers_logprobs(model: Any, ids: list[int]) -> np.ndarray:
    """log_softmax of the logits at every position, float32: ``[len(ids), vocab]``."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def test_prompt_logprobs_equal_transformers(loaded: Any, tokenizer: Any, prompts: list[list[int]],
                                            hf_causal_lm: Any) -> None:  # fmt: skip
    backend, info = loaded
    engine = LLMEngine(backend, tokenizer, info, EngineConfig(block_size=BLOCK, num_blocks=64,
                                                              max_num_batched_tokens=20))  # fmt: skip
    long = tokenizer.encode("Prompt logprobs score every token of a prompt against the tokens before it, " * 3)
    cases = [*prompts, long]
    for i, ids in enumerate(cases):
        engine.add_request(f"p{i}", ids, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP))
    engine.add_request("plain", cases[0], SamplingParams(temperature=0.0, max_tokens=2))
    got: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in got
                got[out.request_id] = out.prompt_logprobs
    assert "plain" not in got and set(got) == {f"p{i}" for i in range(len(cases))}
    for i, ids in enumerate(cases):
        want = transformers_logprobs(hf_causal_lm, ids)
        entries = got[f"p{i}"]
        assert len(entries) == len(ids) and entries[0] is None
        mine = np.array([e.logprob for e in entries[1:]])
        theirs = want[np.arange(len(ids) - 1), ids[1:]]
        np.testing.assert_allclose(mine, theirs, atol=ATOL, rtol=0, err_msg=f"prompt {i}")
        for pos, entry in enumerate(entries[1:]):
            top_ids = [t for t, _, _ in entry.top]
            assert len(top_ids) == TOP
            np.testing.assert_allclose([lp for _, _, lp in entry.top], want[pos, top_ids], atol=ATOL, rtol=0)
            # the best alternatives are transformers' best (ties within the tolerance aside)
            assert want[pos, top_ids[-1]] >= np.sort(want[pos])[-TOP] - ATOL
