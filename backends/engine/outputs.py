"""What the engine hands back: per-step deltas and counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one generated token and, if asked, the best alternatives.

    ``token`` is the token's text as decoded on its own (special tokens kept),
    so a token holding part of a UTF-8 character reads as U+FFFD, as in OpenAI's
    API. ``top`` is best first: ``(token_id, token, logprob)``.
    """

    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]


@dataclass(frozen=True)
class RequestTimings:
    """When a request reached each stage, as ``time.perf_counter()`` readings (the gateway's traces
    take its queue wait, prefill and decode from these)."""

    arrived: float  # handed to the engine
    admitted: float  # first scheduled into a batch
    first_token: float  # its first token sampled
    finished: float  # its last token sampled


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress in one step (deltas, not totals).

    ``new_text`` may be empty while ``new_token_ids`` is not: text is held back
    while a character is split across tokens or might be the start of a stop
    string. The token that triggered a stop (eos, a stop token id) is in
    ``new_token_ids`` and counted in ``completion_tokens`` but adds no text.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    prompt_tokens: int
    completion_tokens: int  # total so far
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    # With params.prompt_logprobs, in the request's first output only: one per prompt token,
    # None for the first (nothing came before it to predict it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The stop string that ended the text (finish_reason "stop"); None when an end-of-sequence or
    # stop token did, or for any other finish (Anthropic's stop_sequence, vLLM's stop_reason).
    stop_string: str | None = None
    timings: RequestTimings | None = None  # in a request's last output, unless it was aborted
    # finish_reason "error": why the request ended (its grammar's mask failed); AsyncEngine raises it
    # as a GrammarTooComplexError instead of delivering the output.
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_total: int
    block_size: int
    num_preemptions: int  # total since start
    num_tokens_processed: int  # tokens run through forward (prefill + decode), total
    num_tokens_generated: int  # tokens sampled, total
    num_steps: int
    max_num_seqs: int
    max_model_len: int
    num_cached_blocks: int = 0  # full blocks whose KV the prefix cache holds (in use or evictable)
    prefix_cache_queried_tokens: int = 0  # tokens of admitted sequences looked up in the prefix cache, total
    prefix_cache_hit_tokens: int = 0  # of those, tokens whose KV was reused, total
    spec_proposed_tokens: int = 0  # draft tokens verified by speculative decoding, total
    spec_accepted_tokens: int = 0  # of those, tokens accepted, total
    num_swapped: int = 0  # sequences whose KV is parked in swap space now
    num_swap_outs: int = 0  # preemptions that parked KV instead of dropping it, total
    num_swapped_out_blocks: int = 0  # KV blocks written to swap space, total
    num_swapped_in_blocks: int = 0  # KV blocks read back from swap space, total
    waiting_per_tenant: dict[str | None, int] = field(default_factory=dict)  # of num_waiting, by tenant
    # Embedding requests (AsyncEngine.embed) queued or running between steps, in all and by tenant.
    num_waiting_embeddings: int = 0
    embeddings_waiting_per_tenant: dict[str | None, int] = field(default_factory=dict)
    num_tokens_embedded: int = 0  # input tokens run for embeddings, total
    # Token slots holding computed KV of running sequences, and slots of the blocks in use (BlockManager.kv_slots).
    kv_slots_used: int = 0
    kv_slots_allocated: int = 0
    # The engine thread's CPU seconds while it had work (AsyncEngine; a backend's wait on its device excluded), total.
    engine_thread_cpu_seconds: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    @property
    def kv_slot_utilisation(self) -> float:
        """Used / allocated KV slots (1.0 with nothing allocated: no slot is wasted)."""
        return self.kv_slots_used / self.kv_slots_allocated if self.kv_slots_allocated else 1.0
