"""Compiling a grammar under a budget: worker processes that can be stopped.

llguidance builds a grammar in native code that nothing can interrupt, and not all of
that work counts against its own fuel limits: a string whose ``allOf`` holds 20
``pattern``s takes 5 s and 250 MB to refuse, 24 take more than 30 s and 1.2 GB, and the
cost doubles with each pattern more. A thread running that cannot be stopped, and
its memory is the gateway's. So each grammar the engine has not compiled before is
first built, and its first mask computed, in a worker process
(``grammar_worker.py``) under a ``GrammarBudget``: CPU time, wall time and memory;
the parent reads the worker's CPU time and resident memory from /proc while it
waits (``grammar_process.WorkerProcess``) and kills it the moment one is over
(rlimits in the worker are the backstop), and kills it as well when the caller
cancels (the client left, the server is draining). A killed worker is replaced
on the next check.

What passes is built again in the engine's own process, where it costs what it
cost in the worker (the same grammar, limits and vocabulary: llguidance is
deterministic), so no unchecked grammar is ever built in-process. Verdicts are
remembered by the grammar's digest: a grammar seen before, accepted or refused, is
answered without a worker.

``GrammarSandbox.check`` is synchronous and thread-safe; the gateway calls it on a
thread with a ``threading.Event`` it sets when the request is cancelled. At most
``workers`` checks run at once; the others wait for a free worker, at most
``queue_seconds`` (then ``GrammarBusyError``, a 503). A free worker goes to the
waiting check whose ``owner`` (the gateway's tenant) holds the fewest workers, among
those to the one served longest ago: one tenant's queue of hostile grammars delays
another tenant's new grammar by one compile, not by its whole queue.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .errors import GrammarBusyError, GrammarCancelledError, GrammarTooComplexError
from .grammar_process import WorkerProcess

log = logging.getLogger(__name__)

MiB = 1 << 20
VOCABULARY_SECONDS = 60.0  # a worker's first use of a vocabulary loads it (about 0.5 s), outside the budget
VERDICTS = 4096  # grammars whose verdict is remembered (a digest and a few numbers each)


@dataclass(frozen=True)
class GrammarBudget:
    """What building a request's new grammars, and computing their first masks, may cost together
    (each grammar's check gets what the ones before it left: ``less``)."""

    cpu_seconds: float = 1.0
    wall_seconds: float = 5.0  # a busy host stretches CPU time into more wall time; this bounds that too
    memory_bytes: int = 512 * MiB  # resident (and address space) above the worker's baseline, each grammar
    queue_seconds: float = 30.0  # the longest wait for a free worker, each grammar (then 503)

    def covers(self, other: GrammarBudget) -> bool:
        """Whether a grammar over ``self`` is over ``other`` too (each of its bounds at least ``other``'s)."""
        return (self.cpu_seconds >= other.cpu_seconds and self.wall_seconds >= other.wall_seconds
                and self.memory_bytes >= other.memory_bytes)  # fmt: skip

    def less(self, verdict: Verdict) -> GrammarBudget:
        """What is left for the request's next grammar once ``verdict``'s was built."""
        return replace(self, cpu_seconds=self.cpu_seconds - verdict.cpu_seconds,
                       wall_seconds=self.wall_seconds - verdict.wall_seconds)  # fmt: skip


DEFAULT_BUDGET = GrammarBudget()

# llguidance's own limits (``LLParserLimits``), for the compile and for every mask while decoding:
# its defaults, but a fifth of the lexer states and errors without the grammar and the parser's state.
# A grammar's lexer (shared by every sequence decoding under it) grows as its masks are computed, by
# about 16 states a token of a string with a maxLength, of 0.4 to 2 kB each: 250,000 states is 100 to
# 500 MB for one grammar, 50,000 is 20 to 100 MB and still a bounded string of about 3,000 tokens.
PARSER_LIMITS: dict[str, Any] = {"max_lexer_states": 50_000, "verbose_errors": False}


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer as a worker builds it (llguidance's ``LLTokenizer`` from the ``tokenizers`` JSON)."""

    name: str  # a digest of the rest
    tokenizer_json: str = field(repr=False)
    n_vocab: int
    eos: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer_json: str, n_vocab: int, eos: tuple[int, ...]) -> Vocabulary:
        digest = hashlib.sha256(f"{n_vocab}:{list(eos)}:".encode() + tokenizer_json.encode()).hexdigest()
        return cls(digest, tokenizer_json, n_vocab, eos)


@dataclass(frozen=True)
class Verdict:
    error: str | None  # llguidance's objection (a construct it cannot compile), or None: it compiles
    bytes: int  # the worker's resident growth while building it: the compiled grammar's weight
    cpu_seconds: float = 0.0  # what this check cost (0 for a remembered verdict)
    wall_seconds: float = 0.0


@dataclass(frozen=True)
class _Refusal:
    reason: str
    budget: GrammarBudget


@dataclass
class SandboxStats:
    checks: int = 0  # checks asked for
    remembered: int = 0  # answered from a remembered verdict
    over_budget: int = 0  # workers killed (or dead) over a budget
    cancelled: int = 0  # workers killed because the caller cancelled
    busy: int = 0  # refused: no worker free within queue_seconds
    workers_started: int = 0


@dataclass(eq=False)
class _Ticket:
    owner: str | None


class GrammarSandbox:
    """A pool of at most ``workers`` grammar worker processes, started when needed, and the verdicts so far."""

    def __init__(self, workers: int = 2, *, poll_seconds: float = 0.02) -> None:
        self.size = workers
        self.poll_seconds = poll_seconds
        self.stats = SandboxStats()
        self._cond = threading.Condition()
        self._idle: list[WorkerProcess] = []
        self._busy: set[WorkerProcess] = set()
        self._alive = 0
        self._waiting: list[_Ticket] = []  # checks waiting for a worker, in arrival order
        self._held: dict[str | None, int] = {}  # workers each owner holds now
        self._grants = 0
        self._last_grant: dict[str | None, int] = {}  # when each owner last got a worker (a grant's number)
        self._verdicts: OrderedDict[str, Verdict | _Refusal] = OrderedDict()

    def resize(self, workers: int) -> None:
        """At most ``workers`` at once from now on (idle ones beyond it are stopped)."""
        with self._cond:
            self.size = workers
            extra = self._idle[workers:]
            del self._idle[workers:]
            self._alive -= len(extra)
            self._cond.notify_all()
        for worker in extra:
            worker.kill()

    def close(self) -> None:
        """Stop the idle workers; a check in flight stops its own when it ends. The pool starts again on use."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._alive -= len(idle)
        for worker in idle:
            worker.kill()

    def check(self, grammar: str, vocabulary: Vocabulary | None = None, budget: GrammarBudget = DEFAULT_BUDGET,
              cancel: threading.Event | None = None, limits: dict[str, Any] | None = None,
              owner: str | None = None) -> Verdict:  # fmt: skip
        """``grammar`` (llguidance's JSON form) built, for ``vocabulary`` with its first mask (without one:
        validated), within ``budget``. Returns what llguidance said of it; raises ``GrammarTooComplexError``
        over the budget, ``GrammarBusyError`` when no worker was free in time, ``GrammarCancelledError``
        once ``cancel`` is set. ``owner``: whose check it is, for sharing the workers fairly."""
        limits = PARSER_LIMITS if limits is None else limits
        digest = hashlib.sha256(json.dumps([grammar, vocabulary.name if vocabulary else None, limits],
                                           sort_keys=True).encode()).hexdigest()  # fmt: skip
        with self._cond:
            self.stats.checks += 1
            known = self._verdicts.get(digest)
            if isinstance(known, Verdict) or (isinstance(known, _Refusal) and budget.covers(known.budget)):
                self._verdicts.move_to_end(digest)
                self.stats.remembered += 1
                if isinstance(known, _Refusal):
                    raise GrammarTooComplexError(known.reason)
                return replace(known, cpu_seconds=0.0, wall_seconds=0.0)
        if budget.cpu_seconds <= 0 or budget.wall_seconds <= 0:
            raise GrammarTooComplexError("the grammars are too complex to compile: the ones before this one used "
                                         "the request's whole budget (grammar.cpu_seconds, grammar.wall_seconds)")
        worker = self._acquire(budget, cancel, owner)
        try:
            verdict = self._run(worker, grammar, vocabulary, budget, cancel, limits)
        except GrammarTooComplexError as exc:
            self._discard(worker, owner)
            self._remember(digest, _Refusal(exc.message, budget))
            raise
        except BaseException:
            self._discard(worker, owner)
            raise
        self._release(worker, owner)
        self._remember(digest, verdict)
        return verdict

    # -- the pool

    def _acquire(self, budget: GrammarBudget, cancel: threading.Event | None, owner: str | None) -> WorkerProcess:
        deadline = time.monotonic() + budget.queue_seconds
        ticket = _Ticket(owner)
        with self._cond:
            self._waiting.append(ticket)
            try:
                while not (self._has_free() and self._next() is ticket):
                    if cancel is not None and cancel.is_set():
                        raise GrammarCancelledError("the grammar check was cancelled while it waited for a worker")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.stats.busy += 1
                        raise GrammarBusyError(f"every grammar worker stayed busy for {budget.queue_seconds:g} s "
                                               "(grammar.queue_seconds); retry later")  # fmt: skip
                    self._cond.wait(min(remaining, self.poll_seconds * 5))
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()  # the next in line may be another
            self._held[owner] = self._held.get(owner, 0) + 1
            self._grants += 1
            self._last_grant[owner] = self._grants
            if len(self._last_grant) > VERDICTS:  # owners long gone
                del self._last_grant[min(self._last_grant, key=self._last_grant.__getitem__)]
            worker = self._idle.pop() if self._idle else None
            if worker is None:
                self._alive += 1
        if worker is None:
            try:
                worker = WorkerProcess()
            except BaseException:
                self._give_back(None, owner, kept=False)
                raise
            with self._cond:
                self.stats.workers_started += 1
        with self._cond:
            self._busy.add(worker)
        return worker

    def _has_free(self) -> bool:
        return bool(self._idle) or self._alive < self.size

    def _next(self) -> _Ticket:
        """The waiting check a free worker goes to: of the owners holding the fewest workers, the one served
        longest ago (or never), its earliest check (``min`` keeps the first of equals)."""
        return min(self._waiting, key=lambda t: (self._held.get(t.owner, 0), self._last_grant.get(t.owner, -1)))

    def _release(self, worker: WorkerProcess, owner: str | None) -> None:
        with self._cond:
            kept = len(self._idle) < self.size
            if kept:
                self._idle.append(worker)
        if not kept:
            worker.kill()
        self._give_back(worker, owner, kept)

    def _discard(self, worker: WorkerProcess, owner: str | None) -> None:
        worker.kill()
        self._give_back(worker, owner, kept=False)

    def _give_back(self, worker: WorkerProcess | None, owner: str | None, kept: bool) -> None:
        """``owner`` no longer holds ``worker`` (None: one that never started); one not kept idle is gone."""
        with self._cond:
            if worker is not None:
                self._busy.discard(worker)
            if not kept:
                self._alive -= 1
            self._held[owner] -= 1
            if not self._held[owner]:
                del self._held[owner]
            self._cond.notify_all()

    def _remember(self, digest: str, verdict: Verdict | _Refusal) -> None:
        with self._cond:
            self._verdicts[digest] = verdict
            while len(self._verdicts) > VERDICTS:
                self._verdicts.popitem(last=False)

    # -- one check

    def _run(self, worker: WorkerProcess, grammar: str, vocabulary: Vocabulary | None, budget: GrammarBudget,
             cancel: threading.Event | None, limits: dict[str, Any]) -> Verdict:  # fmt: skip
        request: dict[str, Any] = {"grammar": grammar, "limits": limits, "cpu_seconds": budget.cpu_seconds,
                                   "memory_bytes": budget.memory_bytes, "vocabulary": None}  # fmt: skip
        if vocabulary is not None:
            request["vocabulary"] = vocabulary.name
            if vocabulary.name not in worker.vocabularies:
                request.update(tokenizer=vocabulary.tokenizer_json, n_vocab=vocabulary.n_vocab,
                               eos=list(vocabulary.eos))  # fmt: skip
        try:
            worker.send(request)
        except OSError:  # it died while idle: nothing to do with this grammar
            raise GrammarBusyError("a grammar worker stopped before it could take the grammar; retry") from None
        if vocabulary is not None:
            worker.vocabularies.add(vocabulary.name)
        self._wait(worker, budget, cancel, started=False)
        begin = time.monotonic()
        answer = self._wait(worker, budget, cancel, started=True)
        return Verdict(answer.get("error"), int(answer.get("bytes") or 0), float(answer.get("cpu") or 0.0),
                       time.monotonic() - begin)  # fmt: skip

    def _wait(self, worker: WorkerProcess, budget: GrammarBudget, cancel: threading.Event | None,
              started: bool) -> dict[str, Any]:  # fmt: skip
        """The worker's next message: its "started" (not budgeted: it may be loading a vocabulary),
        then its answer, while it keeps within ``budget``."""
        begin = time.monotonic()
        base = worker.usage() if started else None
        limit = budget.wall_seconds if started else VOCABULARY_SECONDS
        while True:
            if cancel is not None and cancel.is_set():
                with self._cond:
                    self.stats.cancelled += 1
                raise GrammarCancelledError("the grammar check was cancelled")
            try:
                message = worker.receive(self.poll_seconds)
            except EOFError:
                if not started:  # before its budget began (loading a vocabulary): not the grammar's doing
                    raise GrammarBusyError("a grammar worker stopped before it started; retry") from None
                raise GrammarTooComplexError(self._death(worker, budget)) from None
            if message is not None:
                return message
            if not started:
                if time.monotonic() - begin > limit:
                    raise GrammarBusyError(f"a grammar worker did not start within {limit:g} s; retry")
                continue
            reason = None
            if time.monotonic() - begin > limit:
                reason = f"it took more than {budget.wall_seconds:.3g} s (grammar.wall_seconds)"
            elif base is not None:
                now = worker.usage()
                if now is not None and now[0] - base[0] > budget.cpu_seconds:
                    reason = f"it needed more than {budget.cpu_seconds:.3g} s of CPU time (grammar.cpu_seconds)"
                elif now is not None and now[1] - base[1] > budget.memory_bytes:
                    reason = f"it needed more than {budget.memory_bytes // MiB} MiB of memory (grammar.memory_bytes)"
            if reason is not None:
                self._over(worker, reason)
                raise GrammarTooComplexError(f"the grammar is too complex to compile: {reason}")

    def _over(self, worker: WorkerProcess, reason: str) -> None:
        with self._cond:
            self.stats.over_budget += 1
        log.info("grammar worker %d stopped: %s", worker.pid, reason)

    def _death(self, worker: WorkerProcess, budget: GrammarBudget) -> str:
        """What a worker that died in a check ran out of (the kernel, or llguidance's aborted allocation, ended it)."""
        code = worker.proc.wait()
        if code == -signal.SIGXCPU:
            reason = f"it needed more than {budget.cpu_seconds:.3g} s of CPU time (grammar.cpu_seconds)"
        elif code in (-signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGBUS):
            reason = f"it needed more than {budget.memory_bytes // MiB} MiB of memory (grammar.memory_bytes)"
        else:
            reason = f"the grammar compiler failed on it (exit status {code})"
        self._over(worker, reason)
        return f"the grammar is too complex to compile: {reason}"

    def snapshot(self) -> dict[str, int]:
        """The counters, and the workers running now (for metrics and tests)."""
        with self._cond:
            return {**asdict(self.stats), "workers": self._alive, "idle": len(self._idle),
                    "waiting": len(self._waiting)}  # fmt: skip

    def busy_pids(self) -> list[int]:
        """The process ids of the workers checking a grammar now."""
        with self._cond:
            return [worker.pid for worker in self._busy]


_shared = GrammarSandbox()
atexit.register(_shared.close)


def shared_sandbox() -> GrammarSandbox:
    """The process's sandbox: every engine's grammars, and the gateway's checks of tools, share its workers."""
    return _shared
