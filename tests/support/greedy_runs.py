"""Reference prompts and a greedy engine run, shared by the backend tests (cpu, mlx, conformance)."""

from __future__ import annotations

from typing import Any

from inferflux.backends.engine import LLMEngine, SamplingParams

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about paged memory."},
    ],
]
RAW_PROMPTS = [
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
]


def reference_prompts(tokenizer: Any) -> list[list[int]]:
    """The chat prompts through the model's template, then the raw ones: token ids."""
    chat = [
        tokenizer.encode(tokenizer.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False)
        for m in CHAT_PROMPTS
    ]
    return chat + [tokenizer.encode(p) for p in RAW_PROMPTS]


def run_greedy(engine: LLMEngine, requests: dict[str, list[int]], n: int, *, stagger: int = 0) -> dict[str, Any]:
    """Greedy ``n`` tokens per request: ``{id: {"tokens": [...], "text": str}}``.

    With ``stagger`` each request joins ``stagger`` steps after the previous one,
    so prefill chunks, decodes and continuations share steps. A drained engine
    must hold no blocks.
    """
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out: dict[str, dict[str, Any]] = {rid: {"tokens": [], "text": ""} for rid in requests}
    pending = list(requests.items())
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and (stagger == 0 or steps % stagger == 0):
            rid, ids = pending.pop(0)
            engine.add_request(rid, ids, params)
            if stagger == 0:
                continue
        for o in engine.step():
            out[o.request_id]["tokens"] += o.new_token_ids
            out[o.request_id]["text"] += o.new_text
        steps += 1
    if engine.stats().num_blocks_used:
        raise AssertionError("finished requests must free every block")
    return out
