"""OPA decisions: Rego evaluated in-process (``regopy``), or by a remote OPA server (``opa-python-client``).

A policy is asked one question, with an input document (``opa_input``) that
names the tenant, principal, roles, model, route, token counts and guardrail
findings. Its answer is either a boolean (allow) or an object
``{"allow": bool, "reasons": [str, ...]}`` (``"deny": [...]`` is read as
reasons too). Anything else, an undefined result included, is a deny: the
default is to refuse.

Embedded policies are compiled when the policy (version) is loaded (and once
more by each evaluating thread). A tenant's embedded policy is evaluated on a
small thread pool of its own so a slow policy never blocks the event loop,
with the policy's timeout counted in the evaluating thread's CPU time from when
it takes the evaluation up: on a busy two-core gateway a decision of under a
millisecond of CPU waited tens of milliseconds, once over 100, for the GIL and a
core, and a wall-clock timeout turned that wait into refusals (503). Waiting is
bounded too, by ``RUN_SECONDS`` of wall time.
An *inline* one (``EmbeddedRego(..., inline=True)``: the resolver makes the
global policies, which only platform admins write, inline) is evaluated on
the calling thread (``decide_now``), before the engine starts: no hand-off, and
no thread taking a core from the model while it runs, which on a two-core
machine cost more than the evaluation itself (docs/benchmarks.md). rego-cpp
cannot be interrupted, so an inline evaluation that overruns its timeout is
only reported as timed out once it ends, and the event loop waited for it: that
is why only the operator's own policies run inline. A remote policy is a POST to the OPA
Data API (``/v1/data/<path>`` with ``{"input": ...}``) with the same timeout
and no retries. On an error or a timeout the policy's ``on_error`` decides:
``allow`` fails open (the decision records the error), ``deny`` fails closed
(``PolicyEngineUnavailable``, 503).

An embedded policy that provably reads only a few input fields, and nothing that
changes on its own (the clock, randomness, the network), answers the same
values of those fields from its ``DecisionCache`` without evaluating again
(``opa_cache``); inline or on the pool, the cache is looked up first.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.guardrails.errors import PolicyDenied, PolicyEngineUnavailable
from inferflux.policy.guardrails.findings import Finding
from inferflux.policy.guardrails.opa_cache import DecisionCache, cacheable_fields
from inferflux.policy.guardrails.rego_input import expressions, query, rego_input
from inferflux.policy.rbac import Principal

if TYPE_CHECKING:
    # A type only: spec imports this module to compile a policy's Rego when it is written.
    from inferflux.policy.guardrails.spec import OpaSettings

log = logging.getLogger("inferflux.guardrails.opa")

MAX_REASONS = 10
MAX_REASON_LENGTH = 300
# Embedded evaluations run here, never on the event loop nor on the default pool that serves the store.
POOL_THREADS = 4
_POOL = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="opa-eval")
QUEUE_SECONDS = 1.0  # longest an embedded evaluation may wait for a thread of _POOL
RUN_SECONDS = 1.0  # longest one may take in wall time once started (its CPU time is bounded by the policy's timeout)
WATCH_GRAIN = 0.001  # how often at most the loop looks at a running evaluation's clocks


class OpaError(Exception):
    """A policy could not be evaluated (compile error, bad answer, server down, timeout)."""


@dataclass(frozen=True)
class OpaDecision:
    """One policy's (or several policies' combined) answer.

    ``error`` is set when the policy could not be evaluated; ``allowed`` then
    follows its ``on_error`` setting.
    """

    allowed: bool
    reasons: tuple[str, ...] = ()
    policy: str = ""
    error: str | None = None

    def raise_for_deny(self) -> None:
        """``PolicyEngineUnavailable`` (503) if it failed closed, ``PolicyDenied`` (403) if denied."""
        if self.allowed:
            return
        if self.error is not None:
            raise PolicyEngineUnavailable(
                f"The access policy '{self.policy}' could not be evaluated ({self.error}); retry shortly"
            )
        raise PolicyDenied(self.reasons, policy=self.policy)

    def to_dict(self) -> dict[str, Any]:
        return {"allowed": self.allowed, "reasons": list(self.reasons), "policy": self.policy, "error": self.error}


def combine(decisions: Sequence[OpaDecision]) -> OpaDecision:
    """Every policy must allow; the first refusal (a deny, or a closed failure) answers."""
    for decision in decisions:
        if not decision.allowed:
            return decision
    errors = [f"{d.policy}: {d.error}" for d in decisions if d.error]
    return OpaDecision(True, (), ",".join(d.policy for d in decisions if d.policy), "; ".join(errors) or None)


def opa_input(
    principal: Principal,
    *,
    model: str,
    route: str,
    prompt_tokens: int,
    max_completion_tokens: int | None = None,
    findings: Iterable[Finding] = (),
    request_id: str | None = None,
    user: str | None = None,
    tools: Iterable[str] = (),
) -> dict[str, Any]:
    """The input document a policy sees (no prompt text: only findings' types, rules and spans; the names
    of the tools the model may call)."""
    return {
        "request_id": request_id,
        "user": user,  # the end user the caller named (OpenAI's ``user``), if it named one
        "tenant": {"id": principal.tenant_id, "name": principal.tenant_name},
        "principal": {"subject": principal.subject, "kind": principal.kind, "key_id": principal.key_id},
        "roles": sorted(principal.roles),
        "scopes": sorted(scope.value for scope in principal.scopes),
        "model": model,
        "route": route,
        "tokens": {"prompt": prompt_tokens, "max_completion": max_completion_tokens},
        "findings": [f.to_dict() for f in findings],
        "tools": list(tools),
    }


def interpret(result: Any, *, defined: bool = True) -> tuple[bool, tuple[str, ...]]:
    """A policy's answer as (allowed, reasons); OpaError if it is neither a boolean nor a decision object."""
    if not defined:
        return False, ("the policy gave no decision for this request",)
    if isinstance(result, bool):
        return result, ()
    if isinstance(result, Mapping) and isinstance(result.get("allow"), bool):
        raw = result.get("reasons", result.get("deny", []))
        if not isinstance(raw, (list, tuple)) or not all(isinstance(r, str) for r in raw):
            raise OpaError("the policy's reasons are not a list of strings")
        reasons = tuple(r[:MAX_REASON_LENGTH] for r in raw[:MAX_REASONS])
        return result["allow"], reasons
    raise OpaError("the policy answered neither a boolean nor {allow, reasons}")


class PolicyEngine(Protocol):
    name: str
    inline: bool  # True: decided by ``decide_now`` on the calling thread, before the engine starts

    async def decide(self, document: Mapping[str, Any]) -> OpaDecision: ...

    async def aclose(self) -> None: ...


class _Engine:
    """What both engines share: the timeout, and turning a failure into the policy's fail-open or fail-closed."""

    inline = False

    def __init__(self, name: str, settings: OpaSettings) -> None:
        self.name = name
        self.timeout = settings.timeout_ms / 1000
        self.fail_open = settings.fail_open

    async def _evaluate(self, document: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
        raise NotImplementedError

    async def _evaluate_in_time(self, document: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
        """``_evaluate`` within the policy's timeout; TimeoutError past it."""
        return await asyncio.wait_for(self._evaluate(document), self.timeout)

    async def decide(self, document: Mapping[str, Any]) -> OpaDecision:
        try:
            allowed, reasons = await self._evaluate_in_time(document)
        except (TimeoutError, asyncio.TimeoutError):
            return self._failed(f"timed out after {self.timeout * 1000:.0f} ms")
        except OpaError as exc:
            return self._failed(str(exc))
        return OpaDecision(allowed, reasons, self.name)

    def _failed(self, error: str) -> OpaDecision:
        outcome = "failing open" if self.fail_open else "failing closed"
        log.warning("OPA policy %r could not be evaluated (%s); %s", self.name, error, outcome)
        return OpaDecision(self.fail_open, (), self.name, error)

    async def aclose(self) -> None:
        return None


def _entrypoint(query: str) -> str:
    return query.removeprefix("data.").replace(".", "/")


def load_regopy() -> Any:
    """The ``regopy`` module, loaded after the native libraries it must follow.

    With regopy's ``librego_shared.so`` loaded first, loading ``re2``'s or
    torch's native library afterwards corrupts the heap and aborts the process
    (seen as "munmap_chunk(): invalid pointer" or "double free" in their static
    initialisers); loaded after them, all three work together. ``re2`` is
    imported by this package already; torch, when installed, is imported here.
    Every use of regopy in the project goes through this function.
    """
    if "regopy" not in sys.modules:
        import re2  # noqa: F401

        if "torch" not in sys.modules and importlib.util.find_spec("torch") is not None:
            import torch  # noqa: F401
    import regopy

    return regopy


def _compile(rego: str, query: str) -> tuple[Any, Any]:
    regopy = load_regopy()
    interpreter = regopy.Interpreter()
    try:
        interpreter.add_module("policy.rego", rego)
        bundle = interpreter.build(None, [_entrypoint(query)])
    except regopy.RegoError as exc:
        raise OpaError(f"the Rego policy does not compile: {_rego_message(exc)}") from None
    if not bundle.ok():
        raise OpaError("the Rego policy does not compile")
    return interpreter, bundle


def _rego_message(exc: Exception) -> str:
    # rego-cpp errors are S-expressions; keep the messages and their places.
    text = str(exc)
    messages = [line.strip()[len("(errormsg ") :].rstrip(")") for line in text.splitlines() if "(errormsg" in line]
    places = [line.strip()[len("(error ") :] for line in text.splitlines() if line.strip().startswith("(error ")]
    parts = [f"{m.split(':', 1)[-1]} at {p.split(':', 1)[-1]}" for m, p in zip(messages, places, strict=False)]
    return "; ".join(parts[:3]) or text[:300]


def check_rego(rego: str, query: str) -> None:
    """ValidationFailed (on ``spec.opa.rego``) unless ``rego`` compiles with an entry point for ``query``."""
    try:
        _compile(rego, query)
    except OpaError as exc:
        raise ValidationFailed(str(exc), param="spec.opa.rego") from None


class EmbeddedRego(_Engine):
    """A Rego policy evaluated in-process by rego-cpp (``regopy``), compiled once per evaluating thread.

    An interpreter holds its input between ``set_input`` and the query, so each
    thread of the pool gets an interpreter of its own and evaluations run side
    by side rather than queueing on one; only the evaluation itself releases
    the GIL (``rego_input.query``). The input term is built before the hand-off
    (``rego_input``: quick Python work, where parsing JSON text on the thread
    cost most of a decision), so the thread only sets it and runs the query.
    """

    def __init__(self, name: str, settings: OpaSettings, *, inline: bool = False) -> None:
        super().__init__(name, settings)
        if settings.rego is None:
            raise ValueError("an embedded OPA policy needs its Rego source")
        self._rego, self._query = settings.rego, settings.query
        self._entrypoint_bytes = _entrypoint(settings.query).encode()
        self._local = threading.local()
        self._local.compiled = _compile(self._rego, self._query)  # a bad policy fails here, not on a request
        self.inline = inline
        # decide_now's interpreter, compiled here so that no request's thread compiles;
        # a second thread deciding meanwhile uses its own (``_compiled``).
        self._inline_compiled = _compile(self._rego, self._query) if inline else None
        self._inline_lock = threading.Lock()
        self._inline_input: Any = None
        self.cache = DecisionCache(cacheable_fields(self._rego))  # off (None) unless a decision can be reused

    def _compiled(self) -> tuple[Any, Any]:
        compiled = getattr(self._local, "compiled", None)
        if compiled is None:
            compiled = self._local.compiled = _compile(self._rego, self._query)
        return compiled

    def evaluate(self, document: Mapping[str, Any], deadline: float | None = None) -> tuple[bool, tuple[str, ...]]:
        """Evaluate synchronously (on the calling thread); OpaError on failure.

        ``deadline`` (``time.monotonic()``): past it, do not start.
        """
        return self._evaluate_prepared(prepare_input(document), deadline)

    def decide_now(self, document: Mapping[str, Any]) -> OpaDecision:
        """The decision, evaluated on the calling thread (an inline policy's, on the event loop).

        Nothing can stop an evaluation midway: one that overruns the policy's
        timeout is treated as timed out (``on_error``) once it ends, and logged.
        What counts is this thread's CPU time: the policy's own cost, not time
        the thread spent descheduled or waiting for the GIL on a busy machine.
        """
        key = self.cache.key(document)
        remembered = self.cache.get(key)
        if remembered is not None:
            return OpaDecision(*remembered, self.name)
        started = time.thread_time()
        try:
            prepared = prepare_input(document)
            if self._inline_compiled is not None and self._inline_lock.acquire(blocking=False):
                try:
                    self._inline_input = prepared  # held while the interpreter points into it
                    allowed, reasons = self._ask(self._inline_compiled, prepared)
                finally:
                    self._inline_lock.release()
            else:
                allowed, reasons = self._evaluate_prepared(prepared, None)
        except OpaError as exc:
            return self._failed(str(exc))
        spent = time.thread_time() - started
        if spent > self.timeout:
            return self._failed(f"took {spent * 1000:.0f} ms, past its {self.timeout * 1000:.0f} ms timeout")
        self.cache.put(key, (allowed, reasons))
        return OpaDecision(allowed, reasons, self.name)

    def _evaluate_prepared(self, prepared: Any, deadline: float | None) -> tuple[bool, tuple[str, ...]]:
        """The decision for an input made by ``prepare_input``, on the calling thread's own interpreter."""
        if deadline is not None and time.monotonic() > deadline:
            raise OpaError("no time left to evaluate (the gateway is overloaded)")
        compiled = self._compiled()
        self._local.input = prepared  # the interpreter points into it until it gets the next one
        return self._ask(compiled, prepared)

    def _ask(self, compiled: tuple[Any, Any], prepared: Any) -> tuple[bool, tuple[str, ...]]:
        regopy = load_regopy()
        interpreter, bundle = compiled
        try:
            ok, text = query(regopy, interpreter, bundle, self._entrypoint_bytes, prepared)
            if not ok:
                raise OpaError(f"evaluation failed: {text[:300]}")
            found = expressions(text)
        except (regopy.RegoError, TypeError, ValueError) as exc:
            raise OpaError(f"evaluation failed: {exc}") from None
        return interpret(found[0] if found else None, defined=bool(found))

    async def _evaluate_in_time(self, document: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
        # The policy's timeout bounds the CPU time of its evaluation, from when a
        # thread takes it up (as ``decide_now`` counts an inline one's): time the
        # thread spends waiting for the GIL or a core is the gateway's load, not the
        # policy's cost. The wait is bounded by RUN_SECONDS of wall time, and the wait
        # for a thread by QUEUE_SECONDS (an evaluation that waited longer is not started).
        # One future, one timer and one wake-up of the loop per decision: this
        # runs on every request, so no executor wrappers, shields or wait_for.
        key = self.cache.key(document)
        remembered = self.cache.get(key)
        if remembered is not None:
            return remembered
        prepared = prepare_input(document)  # plain Python work, done here rather than on the evaluating thread
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[tuple[bool, tuple[str, ...]]] = loop.create_future()
        queued = time.monotonic()
        running: list[tuple[float, Callable[[], float], float]] = []  # (started, the thread's CPU clock, its reading)

        def run() -> None:
            cpu = thread_cpu_clock()
            cpu_before = cpu()
            running.append((time.monotonic(), cpu, cpu_before))
            try:
                result: Any = self._evaluate_prepared(prepared, queued + QUEUE_SECONDS)
                if cpu() - cpu_before > self.timeout:  # ended between two looks of ``watch``
                    result = TimeoutError()
            except Exception as exc:  # handed to the awaiting task, which decides what it means
                result = exc
            try:
                loop.call_soon_threadsafe(_settle, answer, result)
            except RuntimeError:  # the loop is closed: nobody waits for this answer any more
                pass

        job = _POOL.submit(run)
        wall = max(self.timeout, RUN_SECONDS)

        def watch() -> None:
            if answer.done():
                return
            now = time.monotonic()
            if running:
                started, cpu, cpu_before = running[0]
                try:
                    left = self.timeout - (cpu() - cpu_before)
                except OSError:  # its thread is gone (the pool shut down with the process): no answer comes
                    left = 0
                if left <= 0:
                    answer.set_exception(TimeoutError())
                    return
                if now - started >= wall:
                    answer.set_exception(OpaError(f"no decision within {wall:.1f} s (the gateway is overloaded)"))
                    return
                left = min(left, started + wall - now)
            else:  # look again within one timeout: it may start meanwhile
                left = min(self.timeout, queued + QUEUE_SECONDS - now)
                if left <= 0:
                    job.cancel()  # still queued: it will not start
                    answer.set_exception(
                        OpaError(f"no evaluator free within {QUEUE_SECONDS:.0f} s (the gateway is overloaded)")
                    )
                    return
            timer[0] = loop.call_later(max(left, WATCH_GRAIN), watch)

        timer = [loop.call_later(self.timeout, watch)]
        try:
            decided = await answer
        finally:
            timer[0].cancel()
        self.cache.put(key, decided)
        return decided


def thread_cpu_clock() -> Callable[[], float]:
    """The calling thread's CPU time in seconds, as a clock any thread can read while this one lives.

    Where the platform cannot read another thread's CPU time (macOS), the
    monotonic clock stands in: there the timeout counts wall time, as before.
    """
    if _CPU_CLOCK_ID is None:
        return time.monotonic
    cpu = _CPU_CLOCK_ID(threading.get_ident())  # the pool's threads live as long as the process
    return lambda: time.clock_gettime(cpu)


_CPU_CLOCK_ID = getattr(time, "pthread_getcpuclockid", None)  # absent on macOS


def _settle(answer: asyncio.Future[Any], result: Any) -> None:
    if answer.done():  # timed out, or the request went away
        return
    if isinstance(result, BaseException):
        answer.set_exception(result)
    else:
        answer.set_result(result)


def prepare_input(document: Any) -> Any:
    """``document`` as rego-cpp's input term (``rego_input``); OpaError if JSON cannot carry it."""
    try:
        return rego_input(load_regopy(), document)
    except ValueError as exc:
        raise OpaError(f"evaluation failed: {exc}") from None


class RemoteOpa(_Engine):
    """A policy on an OPA server, asked over its Data API with ``opa_client.AsyncOpaClient``."""

    def __init__(self, name: str, settings: OpaSettings) -> None:
        super().__init__(name, settings)
        if settings.url is None or settings.path is None:
            raise ValueError("a remote OPA policy needs the server's url and the decision's path")
        parts = urlsplit(settings.url)
        self._host = parts.hostname or ""
        self._tls = parts.scheme == "https"
        self._port = parts.port or (443 if self._tls else 80)
        self._path = settings.path
        self._token = settings.token
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _session(self) -> Any:
        from opa_client import AsyncOpaClient

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # a client's session belongs to one loop
            client = AsyncOpaClient(
                host=self._host, port=self._port, ssl=self._tls, token=self._token, retries=0, timeout=self.timeout
            )
            await client.__aenter__()
            self._client, self._loop = client, loop
        return self._client

    async def _evaluate(self, document: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
        import aiohttp

        try:
            client = await self._session()
            answer = await client.query_rule(input_data=dict(document), package_path=self._path)
        except TimeoutError:
            raise  # the client's own timeout (an OSError too): reported as the policy's timeout
        except aiohttp.ClientResponseError as exc:
            raise OpaError(f"the OPA server answered {exc.status}") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise OpaError(f"the OPA server cannot be reached: {type(exc).__name__}") from None
        if not isinstance(answer, Mapping):
            raise OpaError("the OPA server's answer is not a JSON object")
        return interpret(answer.get("result"), defined="result" in answer)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.close_connection()


def build_engine(name: str, settings: OpaSettings, *, inline: bool = False) -> PolicyEngine:
    """The engine for one policy's OPA settings; OpaError if its Rego does not compile.

    ``inline``: an embedded policy is decided on the request's thread (``EmbeddedRego.decide_now``);
    only for policies the operator wrote. A remote policy is always awaited.
    """
    if settings.engine == "embedded":
        return EmbeddedRego(name, settings, inline=inline)
    return RemoteOpa(name, settings)


def decide_inline(engines: Sequence[PolicyEngine], document: Mapping[str, Any]) -> OpaDecision:
    """Ask every inline engine, one after another on this thread; allowed only if all allow."""
    decisions = []
    for engine in engines:
        decision = engine.decide_now(document)  # type: ignore[attr-defined]  # inline engines are EmbeddedRego
        if not decision.allowed:
            return decision
        decisions.append(decision)
    return combine(decisions)


async def decide_all(engines: Sequence[PolicyEngine], document: Mapping[str, Any]) -> OpaDecision:
    """Ask every engine (concurrently); allowed only if all allow."""
    if not engines:
        return OpaDecision(True)
    if len(engines) == 1:  # the usual case: no task per engine
        return combine([await engines[0].decide(document)])
    return combine(await asyncio.gather(*(engine.decide(document) for engine in engines)))
