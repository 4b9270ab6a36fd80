"""The synchronous engine: schedule -> forward -> sample -> detokenize.

Not thread-safe: one thread owns an ``LLMEngine`` (``AsyncEngine`` runs it on
its own thread). ``make_request`` is the exception: it reads only
configuration and may be called from any thread; the ``EngineRequest`` it
returns is checked once and trusted by ``add`` (``backends.engine.request``).
Its sizes and their resolution are in ``config``; ``make_request``'s checks in
``request.EngineRequestChecks`` and its embedding methods in
``embedding.EngineEmbeddings``, which it inherits.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from inferflux.backends.base import Backend, ModelInfo

from .block_manager import BlockManager
from .config import (
    DEFAULT_KV_CACHE_BYTES,
    EngineConfig,
    allocate_swap,
    resolve_max_model_len,
    resolve_num_blocks,
    with_block_size,
)
from .detokenizer import DecodingTokenizer, IncrementalDetokenizer
from .embedding import EngineEmbeddings
from .errors import DuplicateRequestError, InvalidRequestError
from .grammar_compiler import GrammarCompiler
from .outputs import EngineStats, RequestOutput, RequestTimings, TokenLogprob
from .prompt_logprobs import entries, prompt_rows, score_rows
from .request import EngineRequest, EngineRequestChecks
from .sampler import SampleResult, Sampler
from .scheduler import Scheduler
from .scheduler_output import ScheduledSeq, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .speculative import make_speculator

__all__ = ["DEFAULT_KV_CACHE_BYTES", "EngineConfig", "LLMEngine"]  # the config's names, importable here as before

_KV_OP_METHODS = {"copy": "copy_blocks", "swap_out": "swap_out", "swap_in": "swap_in"}  # BlockManager op -> Backend


class LLMEngine(EngineRequestChecks, EngineEmbeddings):
    def __init__(
        self,
        backend: Backend,
        tokenizer: DecodingTokenizer,
        model_info: ModelInfo,
        config: EngineConfig | None = None,
        draft_backend: Backend | None = None,
    ) -> None:
        """``draft_backend``: the loaded draft model for speculative method "draft" with a
        ``draft_model`` (a self-draft, ``draft_layers``, is made here from ``backend``)."""
        config = config or EngineConfig()
        config.check()
        self.config = config = with_block_size(backend, config)
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.vocab_size = model_info.vocab_size
        self.block_size = config.block_size
        self.num_blocks = resolve_num_blocks(backend, config)
        self.max_model_len = resolve_max_model_len(model_info, config)

        backend.allocate_kv(self.num_blocks, self.block_size)
        self.num_swap_blocks = allocate_swap(backend, config, self.num_blocks)
        self.block_manager = BlockManager(
            self.num_blocks,
            self.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_swap_slots=self.num_swap_blocks,
        )
        self.speculator = make_speculator(config.speculative, backend, draft_backend, self.num_blocks, self.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.speculator,
            preemption_mode=config.preemption_mode,
        )
        self.eos_token_ids = _eos_ids(tokenizer)
        self.sampler = Sampler(self.eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids,
                                        **({} if config.grammar_cache_bytes is None else
                                           {"cache_bytes": config.grammar_cache_bytes}))  # fmt: skip

        self._requests: dict[str, Sequence] = {}
        self._next_seq_id = 0
        self._token_text: dict[int, str] = {}  # for logprobs: id -> text of the token alone
        self.num_steps = 0
        self.num_tokens_processed = 0
        self.num_tokens_generated = 0
        self.num_tokens_embedded = 0

    # -- requests

    def add_request(self, request_id: str, prompt_token_ids: Iterable[int], *args: Any, **kwargs: Any) -> None:
        """Check a request (``make_request``'s arguments) and queue it; it joins the running batch at the next step.

        Raises ``DuplicateRequestError`` for an id already queued, and what
        ``make_request`` raises; queues nothing in that case.
        """
        if request_id in self._requests:
            raise DuplicateRequestError(request_id)
        self.add(self.make_request(request_id, prompt_token_ids, *args, **kwargs))

    def add(self, request: EngineRequest, arrived: float | None = None) -> None:
        """Queue a request ``make_request`` checked (on this engine); only its id's uniqueness is checked here.
        ``arrived``: when it was handed over (``time.perf_counter()``; default now), its timings' start."""
        if request.engine_id != id(self):
            raise InvalidRequestError("the request was checked by another engine", param=None)
        if request.request_id in self._requests:
            raise DuplicateRequestError(request.request_id)
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        seq = Sequence(
            seq_id, request.request_id, request.prompt, request.params, max_tokens=request.max_tokens,
            priority=request.priority, arrival=seq_id, cache_salt=request.cache_salt, tenant=request.tenant,
            weight=request.weight,
        )
        seq.arrived_at = time.perf_counter() if arrived is None else arrived
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt, request.params, self.eos_token_ids)
        if request.grammar is not None:
            seq.guide = request.grammar.guide()
        if request.params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token: nothing before it to predict it
        self._requests[request.request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks. Returns its final output
        (finish_reason "abort"), or None if it is unknown or already finished."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.abort(seq)
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="abort",
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
        )

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in list(self._requests) if (out := self.abort_request(rid)) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    # -- the loop body

    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns an output for every request that got a token.

        If the backend or the sampler raises, no sequence has advanced: the
        same step can be retried, or the requests aborted.
        """
        sched = self.scheduler.schedule()
        self._run_kv_ops(sched)
        if sched.is_empty:
            return []
        logits = self.backend.forward(sched.batch())
        outputs = self._sample(sched, logits)
        for seq in self.scheduler.postprocess(sched):
            self._requests.pop(seq.request_id, None)
        self.num_steps += 1
        self.num_tokens_processed += sched.num_tokens
        self.num_tokens_generated += sum(len(out.new_token_ids) for out in outputs)
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        used, allocated = bm.kv_slots(self.scheduler.running)
        return EngineStats(
            kv_slots_used=used,
            kv_slots_allocated=allocated,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            waiting_per_tenant=dict(self.scheduler.queued),
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_total=bm.num_blocks,
            block_size=bm.block_size,
            num_preemptions=self.scheduler.num_preemptions,
            num_swapped=len(self.scheduler.swapped),
            num_swap_outs=self.scheduler.num_swap_outs,
            num_swapped_out_blocks=bm.num_swapped_out_blocks,
            num_swapped_in_blocks=bm.num_swapped_in_blocks,
            num_tokens_processed=self.num_tokens_processed,
            num_tokens_generated=self.num_tokens_generated,
            num_tokens_embedded=self.num_tokens_embedded,
            num_steps=self.num_steps,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            num_cached_blocks=bm.num_cached_blocks,
            prefix_cache_queried_tokens=bm.num_prefix_queries,
            prefix_cache_hit_tokens=bm.num_prefix_hits,
            spec_proposed_tokens=self.speculator.num_proposed if self.speculator else 0,
            spec_accepted_tokens=self.speculator.num_accepted if self.speculator else 0,
        )

    # -- internals

    def _run_kv_ops(self, sched: SchedulerOutput) -> None:
        """Copies and swaps, in the order the scheduler decided them, before the forward."""
        if not sched.kv_ops:
            return
        for kind, pairs in sched.kv_ops:
            # Swaps only happen with swap space, whose backend methods were checked at start.
            getattr(self.backend, _KV_OP_METHODS[kind])(pairs)
        self.block_manager.copies_done()

    def _sample(self, sched: SchedulerOutput, logits: object) -> list[RequestOutput]:
        """Tokens from the step's logits: plain rows sampled together, each draft verified row by row;
        a prompt's rows (``prompt_logprobs``) scored first, so its first output carries them."""
        if not any(entry.draft or entry.prompt_logits for entry in sched.scheduled):
            seqs = sched.sampled_seqs  # logits row i belongs to seqs[i]
            return [self._append(seq, [s]) for seq, s in zip(seqs, self.sampler.sample(logits, seqs))]
        logits = np.asarray(logits, dtype=np.float32)
        plain: list[tuple[Sequence, int]] = []
        drafted: list[tuple[ScheduledSeq, int]] = []
        row = 0
        for entry in sched.scheduled:
            if entry.prompt_logits:
                self._score_prompt(entry, logits[row : row + entry.prompt_logits])
            first = row + entry.prompt_logits
            if entry.draft:
                drafted.append((entry, first))
            elif entry.samples:
                plain.append((entry.seq, first))
            row += entry.num_logits
        samples = self.sampler.sample(logits[[r for _, r in plain]], [seq for seq, _ in plain])
        outputs = [self._append(seq, [sample]) for (seq, _), sample in zip(plain, samples)]
        outputs += [self._verify(entry, logits[r : r + entry.num_logits]) for entry, r in drafted]
        return outputs

    def _score_prompt(self, entry: ScheduledSeq, rows: np.ndarray) -> None:
        """Record the logprobs of the prompt tokens these rows predict that the sequence lacks."""
        seq = entry.seq
        if seq.prompt_logprobs is None:
            return
        rows, targets = prompt_rows(rows, entry.start_pos, seq.token_ids, len(seq.prompt_logprobs),
                                    seq.num_prompt_tokens)  # fmt: skip
        if targets:
            scored = score_rows(rows, targets, seq.params.prompt_logprobs or 0)
            seq.prompt_logprobs.extend(entries(scored, targets, self._text_of))

    def _verify(self, entry: ScheduledSeq, rows: np.ndarray) -> RequestOutput:
        """Keep the draft's tokens while the target agrees, then the target's own token."""
        seq, draft = entry.seq, entry.draft
        kept: list[SampleResult] = []
        accepted = 0
        masks = self.sampler.draft_masks(seq, draft, rows.shape[1])  # None without a grammar
        if seq.guide is not None and seq.guide.error is not None:
            return self._grammar_failed(seq)
        for i, row in enumerate(rows):
            mask = None if masks is None else masks[i]
            sample, took = self.sampler.verify_row(row, seq, draft[i] if i < len(draft) else None, mask)
            kept.append(sample)
            accepted += took
            if self._push(seq, sample.token_id) is not None or not took:
                break
        if self.speculator is not None:
            self.speculator.observe(seq, len(draft), accepted)
        return self._output(seq, kept)

    def _append(self, seq: Sequence, samples: list[SampleResult]) -> RequestOutput:
        if seq.guide is not None and seq.guide.error is not None:
            return self._grammar_failed(seq)
        for sample in samples:
            self._push(seq, sample.token_id)
        return self._output(seq, samples)

    def _push(self, seq: Sequence, token_id: int) -> str | None:
        """Append one token; its finish reason if it ends the sequence."""
        seq.append_token(token_id)
        seq.first_token_at = seq.first_token_at or time.perf_counter()
        if seq.guide is not None:
            seq.guide.consume(token_id)  # the grammar's state follows the output, and nothing else
        detok = seq.detokenizer
        reason = detok.append(token_id)
        if reason is None and seq.num_output_tokens >= seq.max_tokens:
            reason = detok.finish("length")
        elif reason == "stop" and seq.guide is not None and seq.guide.closed_early:
            reason = "length"  # max_tokens cut the answer; the guide only closed it (guided.Guide.limit)
        if reason is not None:
            seq.status = SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH
        return reason

    def _grammar_failed(self, seq: Sequence) -> RequestOutput:
        """End a sequence whose grammar's mask failed this step (over llguidance's limits): no token is
        appended (the mask allowed only EOS), its blocks are freed with the step's finished sequences,
        and its last output carries the reason. Its grammar leaves the cache (its lexer may be full)."""
        guide = seq.guide
        if guide is None:  # only called for a guided sequence
            raise RuntimeError("_grammar_failed needs a guided sequence")
        seq.status = SequenceStatus.FINISHED_ERROR
        self.grammars.forget(guide.grammar_key)
        out = self._output(seq, [])
        return dataclasses.replace(out, error=f"the grammar went over its limits while decoding: {guide.error}")

    def _output(self, seq: Sequence, samples: list[SampleResult]) -> RequestOutput:
        reason = seq.status.finish_reason if seq.is_finished else None
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[s.token_id for s in samples],
            new_text=seq.detokenizer.take_delta(),
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            logprobs=[self._logprob(s) for s in samples] if seq.params.logprobs else None,
            prompt_logprobs=self._take_prompt_logprobs(seq),
            stop_string=seq.detokenizer.stop_string if reason == "stop" else None,
            timings=None if reason is None else RequestTimings(
                seq.arrived_at, seq.admitted_at, seq.first_token_at, time.perf_counter()),
        )

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs, once (its first output); None after, and without them."""
        if seq.prompt_logprobs is None or seq.prompt_logprobs_sent:
            return None
        seq.prompt_logprobs_sent = True
        return list(seq.prompt_logprobs)

    def _logprob(self, sample: SampleResult) -> TokenLogprob:
        top = [(t, self._text_of(t), lp) for t, lp in sample.top_logprobs or ()]
        return TokenLogprob(sample.token_id, self._text_of(sample.token_id), sample.logprob, top)

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

def _eos_ids(tokenizer: DecodingTokenizer) -> frozenset[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = () if eos is None else (eos,)
    return frozenset(int(t) for t in ids)
