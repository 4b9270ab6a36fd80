"""Runs an LLMEngine on its own thread and streams outputs to asyncio.

Threading rules:

* All engine state is touched only by the engine thread. Other threads hand it
  commands (add, abort) through an inbox guarded by a condition variable; the
  thread sleeps on that condition when it has nothing to do.
* Outputs travel back through one ``asyncio.Queue`` per request, filled with
  ``loop.call_soon_threadsafe`` (one call per event loop per step).
* A request is checked once, in the caller's thread, by ``make_request``
  (``generate`` calls it), so a bad request raises before anything is queued;
  ``stream`` and the engine thread trust the ``EngineRequest`` it returns.
* When a consumer stops iterating (``aclose()``, task cancellation, client
  disconnect) its request is aborted and its KV blocks freed.
* A request whose grammar's mask failed (over llguidance's limits) fails alone, with
  ``GrammarTooComplexError``; its sequence was freed in the step.
* When a step raises, every request in flight fails with ``EngineStepError``
  (raised from ``generate``) and the loop carries on with new requests. Only if
  the engine cannot even abort its requests does it become dead
  (``EngineDeadError`` for everyone).
* Embedding requests (``embed``) cross over through the same inbox into an
  ``EmbeddingQueue``; the thread runs one batch of them (at most a step's token
  budget) before each generation step, without the KV cache. A failed batch
  fails only its own requests: no sequence's state was touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from .embedding import EmbeddingJob, EmbeddingQueue, EmbeddingRequest, EmbeddingResult
from .errors import DuplicateRequestError, EngineDeadError, EngineStepError, GrammarTooComplexError
from .grammar_sandbox import DEFAULT_BUDGET, GrammarBudget
from .guided import GuidedSpec
from .llm_engine import LLMEngine
from .outputs import EngineStats, RequestOutput
from .request import EngineRequest

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    stream: _Stream
    request: EngineRequest
    arrived: float = field(default_factory=time.perf_counter)  # handed over: its queue wait starts here


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Embed:
    job: EmbeddingJob  # its ``stream`` is a _Stream that gets the EmbeddingResult or the exception


_Command = _Add | _Abort | _Embed


class _Outbox:
    """Items for asyncio queues, batched so each event loop is woken once."""

    def __init__(self) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}

    def put(self, stream: _Stream, item: Any) -> None:
        self.by_loop.setdefault(stream.loop, []).append((stream, item))

    def flush(self) -> list[_Stream]:
        """Deliver everything; returns the streams whose event loop is gone."""
        orphaned = []
        for loop, items in self.by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody will read these
                orphaned.extend(stream for stream, _ in items)
        self.by_loop = {}
        return orphaned


def _put_all(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: list[_Command] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._thread: threading.Thread | None = None
        self._dead: EngineDeadError | None = None
        self._active: set[str] = set()  # request ids with a live generate(); guarded by _cond
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._embeddings = EmbeddingQueue(engine.config.max_num_batched_tokens)  # engine thread only
        self._cpu_seconds = 0.0  # the engine thread's CPU while busy (not waiting for work), engine thread only
        self._stats = self._snapshot()  # published by the engine thread

    # -- lifecycle

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._cond:
            if self._thread is not None or self._stopping:
                return
            # From here on only the engine thread calls the backend: let it drop
            # what this (loading) thread holds, e.g. an idle OpenMP team.
            release = getattr(self.engine.backend, "release_thread_pool", None)
            if release is not None:
                release()
            self._thread = threading.Thread(target=self._run, name="inferflux-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop; requests still in flight fail with EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    # -- the API used by the gateway (asyncio thread)

    def make_request(self, request_id: str, prompt_token_ids: Iterable[int], *args: Any, **kwargs: Any) -> EngineRequest:
        """The checked request ``stream`` takes: ``LLMEngine.make_request``'s arguments and errors. Any thread."""
        return self.engine.make_request(request_id, prompt_token_ids, *args, **kwargs)

    def compile_grammar(self, spec: GuidedSpec, budget: GrammarBudget = DEFAULT_BUDGET,
                        cancel: threading.Event | None = None, owner: str | None = None) -> None:  # fmt: skip
        """Compile ``spec`` for this engine under ``budget`` (``GrammarCompiler.compile``, its errors), so that
        ``make_request`` finds it compiled; ``cancel`` set stops it (the caller left). Blocking; any thread."""
        self.engine.grammars.compile(spec, budget, cancel, owner)

    def make_embedding_request(self, request_id: str, inputs: Iterable[Iterable[int]], pooling: str,
                               **kwargs: Any) -> EmbeddingRequest:  # fmt: skip
        """The checked request ``embed`` takes: ``LLMEngine.make_embedding_request``'s arguments and errors. Any thread."""
        return self.engine.make_embedding_request(request_id, inputs, pooling, **kwargs)

    async def generate(
        self, request_id: str, prompt_token_ids: Iterable[int], *args: Any, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """``stream`` of ``make_request``'s request (same arguments): check and run in one call.

        Raises ``InvalidRequestError`` subclasses for a bad request (on the
        first ``__anext__``), and what ``stream`` raises.
        """
        request = self.make_request(request_id, prompt_token_ids, *args, **kwargs)
        # aclosing: a consumer that stops early closes the inner stream now,
        # which aborts the request, rather than whenever it is collected.
        async with contextlib.aclosing(self.stream(request)) as outputs:
            async for output in outputs:
                yield output

    async def stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Run a checked request and stream its outputs (deltas); the last one has ``finished=True``.

        Raises ``DuplicateRequestError`` for an id in flight, ``EngineStepError``
        if a step failed while it ran, ``EngineDeadError`` if the engine is shut down.
        """
        request_id = request.request_id
        stream = _Stream(request_id, asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            self._check_alive()
            if request_id in self._active:
                raise DuplicateRequestError(request_id)
            self._active.add(request_id)
        done = False
        try:
            self.start()
            self._submit(_Add(stream, request))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True  # the engine already dropped the request
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(request_id)
            with self._cond:
                self._active.discard(request_id)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """Run a checked embedding request (``LLMEngine.make_embedding_request``) on the engine thread.

        Raises ``EngineStepError`` if the backend failed on its batch,
        ``EngineDeadError`` if the engine is shut down. Cancelling the caller
        drops the request's inputs not yet run.
        """
        stream = _Stream(request.request_id, asyncio.get_running_loop(), asyncio.Queue())
        job = EmbeddingJob(request, stream)
        self.start()
        self._submit(_Embed(job))
        try:
            item = await stream.queue.get()
        except BaseException:
            job.cancelled = True  # read by the engine thread before its next batch
            raise
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[no-any-return]

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends with finish_reason "abort"."""
        with self._cond:
            if self._stopping or self._dead is not None:
                return  # the loop is gone and has failed every request already
            self._inbox.append(_Abort(request_id))
            self._cond.notify()

    def stats(self) -> EngineStats:
        """The latest snapshot, published by the engine thread after every step, with the thread's CPU
        so far: that is counted once a step's outputs are delivered, after the snapshot, so it is added here."""
        return dataclasses.replace(self._stats, engine_thread_cpu_seconds=self._cpu_seconds)

    # -- engine thread

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead.message)
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    def _submit(self, command: _Command) -> None:
        with self._cond:
            self._check_alive()
            self._inbox.append(command)
            self._cond.notify()

    def _run(self) -> None:
        outbox = _Outbox()
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()
                           or self._embeddings):  # fmt: skip
                    self._cond.wait()
                if self._stopping:
                    break
                commands, self._inbox = self._inbox, []
            # This thread's CPU, not wall time: a backend's wait on its device (which releases the
            # GIL) is not counted, the host's work around it is (issue 47: CPU per step).
            busy_from = time.thread_time()
            self._apply(commands, outbox)
            if self._embeddings:
                self._embed_batch(outbox)
            if self.engine.has_unfinished_requests():
                self._step(outbox)
            # publish before delivering: a consumer that sees its last output
            # also sees the stats of the step that produced it
            self._stats = self._snapshot()
            if self._drop_orphans(outbox.flush()):
                self._stats = self._snapshot()
            self._cpu_seconds += time.thread_time() - busy_from  # read by stats(), not the snapshot
            if self._dead is not None:
                break
        self._close(outbox)

    def _snapshot(self) -> EngineStats:
        """The engine's stats with the embedding requests this thread holds."""
        return dataclasses.replace(self.engine.stats(), num_waiting_embeddings=len(self._embeddings),
                                   embeddings_waiting_per_tenant=self._embeddings.waiting_per_tenant())  # fmt: skip

    def _apply(self, commands: list[_Command], outbox: _Outbox) -> None:
        for cmd in commands:
            if isinstance(cmd, _Embed):
                self._embeddings.add(cmd.job)
            elif isinstance(cmd, _Add):
                try:
                    self.engine.add(cmd.request, arrived=cmd.arrived)
                except Exception as exc:
                    outbox.put(cmd.stream, exc)
                else:
                    self._streams[cmd.stream.request_id] = cmd.stream
            else:
                final = self.engine.abort_request(cmd.request_id)
                stream = self._streams.pop(cmd.request_id, None)
                if stream is not None and final is not None:
                    outbox.put(stream, final)

    def _step(self, outbox: _Outbox) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing %d request(s)", len(self._streams))
            self._fail_all(exc, outbox)
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                outbox.put(stream, out if out.error is None else GrammarTooComplexError(out.error))
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _embed_batch(self, outbox: _Outbox) -> None:
        """One batch of the waiting embedding requests; a failure fails only the requests in it."""
        batch = self._embeddings.next_batch()
        if batch is None:
            return
        try:
            pooled = self.engine.embed(batch.token_lists, batch.pooling)
        except Exception as exc:
            logger.exception("embedding batch failed; failing %d request(s)", len(batch.jobs))
            self._embeddings.drop(batch.jobs)
            for job in batch.jobs:
                err = EngineStepError(f"the engine failed while embedding this request: {exc!r}")
                err.__cause__ = exc
                outbox.put(job.stream, err)
            return
        for job, result in self._embeddings.deliver(batch, pooled):
            outbox.put(job.stream, result)

    def _fail_all(self, cause: BaseException, outbox: _Outbox) -> None:
        try:
            self.engine.abort_all()
        except Exception as exc:
            logger.exception("engine could not abort its requests; it is now dead")
            with self._cond:
                self._dead = EngineDeadError(f"the engine is broken after a failed step: {exc!r}")
        for stream in self._streams.values():
            err = EngineStepError(f"the engine failed while running this request: {cause!r}")
            err.__cause__ = cause
            outbox.put(stream, err)
        self._streams.clear()

    def _drop_orphans(self, orphans: list[_Stream]) -> bool:
        dropped = False
        for stream in orphans:
            if self._streams.pop(stream.request_id, None) is stream:
                self.engine.abort_request(stream.request_id)
                dropped = True
        return dropped

    def _close(self, outbox: _Outbox) -> None:
        """Fail whatever is still pending once the loop stops."""
        with self._cond:
            commands, self._inbox = self._inbox, []
        reason = self._dead or EngineDeadError("the engine is shut down")
        for cmd in commands:
            if isinstance(cmd, _Add):
                outbox.put(cmd.stream, EngineDeadError(str(reason)))
            elif isinstance(cmd, _Embed):
                outbox.put(cmd.job.stream, EngineDeadError(str(reason)))
        for stream in self._streams.values():
            outbox.put(stream, EngineDeadError(str(reason)))
        self._streams.clear()
        for job in self._embeddings.clear():
            outbox.put(job.stream, EngineDeadError(str(reason)))
        try:
            self.engine.abort_all()
        except Exception:
            logger.exception("aborting requests at shutdown failed")
        outbox.flush()
        self._stats = self._snapshot()
