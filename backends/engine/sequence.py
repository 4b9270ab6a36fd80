"""One request's token stream and its bookkeeping. Imports no tensor library."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .detokenizer import IncrementalDetokenizer
    from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV kept in swap slots, waiting for room to resume
    FINISHED_STOPPED = "finished_stopped"  # eos, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or context full
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # its grammar's mask failed (over llguidance's limits): the output says why

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset({SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                       SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_ERROR})  # fmt: skip
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


class Sequence:
    """A request as the scheduler sees it.

    ``token_ids`` is prompt + output. ``num_computed_tokens`` of them have their
    KV in the cache; the rest (the whole prompt for a new or preempted
    sequence, the last sampled token for a decoding one) are fed to the next
    forward passes. ``block_table[i]`` is the physical block that holds
    positions ``i*block_size .. (i+1)*block_size - 1``.
    """

    # Set by the engine and the sampler after construction (these are the defaults until then):
    # per-request state that outlives preemption, so a recomputed sequence continues its text
    # and its random stream exactly.
    detokenizer: IncrementalDetokenizer | None = None
    generator: Any = None  # numpy Generator, owned by the sampler
    prompt_token_set: Any = None  # cached by the sampler for penalties
    logit_bias_arrays: Any = None  # params.logit_bias as (ids, values) arrays, cached by the sampler
    # Structured outputs: the grammar's matcher (guided.Guide), advanced past each output token as
    # it is appended; its state depends on the output alone, so preemption leaves it right.
    guide: Any = None
    # Prompt logprobs (prompt_logprobs.py), when asked for: one entry per prompt token scored
    # so far (None for the first), kept across preemption; sent once, in the first output.
    prompt_logprobs: list[Any] | None = None
    prompt_logprobs_sent: bool = False

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        priority: int = 0,
        arrival: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens resolved against the context
        self.priority = priority  # lower is more important
        self.arrival = arrival  # engine-wide counter: FIFO order within a priority
        # Fair sharing (Scheduler): whose sequence this is, an opaque key (the gateway's
        # tenant id; None is one more tenant), and that tenant's weight, its share of
        # the batch relative to the others' when they compete.
        self.tenant = tenant
        self.weight = weight
        self.status = SequenceStatus.WAITING
        # time.perf_counter() when it was handed to the engine, first scheduled and got its first
        # token (0.0: not yet): its last output's RequestTimings.
        self.arrived_at = 0.0
        self.admitted_at = 0.0
        self.first_token_at = 0.0

        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.swap_slots: list[int] = []  # while SWAPPED: the slots holding its blocks, in table order
        self.num_preemptions = 0
        # Prefix caching: the namespace of this sequence's cached blocks (a tenant's,
        # say; None shares the default one), the chain hashes of its full blocks
        # (valid for as long as its tokens, so kept across preemption), and how
        # many leading blocks of its table are in the cache already.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self.spec_state: Any = None  # speculative decoding's per-sequence state (speculative.SpecState)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, priority={self.priority}, tenant={self.tenant!r})"
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt tokens still lack their logprob: its prefill then asks for every position's logits."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        """Most important first: lower priority number, then earlier arrival."""
        return (self.priority, self.arrival)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
