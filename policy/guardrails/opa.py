"""OPA decisions: Rego evaluated in-process (``regopy``), or by a remote OPA server (``opa-python-client``).

A policy is asked one question, with an input document (``opa_input``) that
names the tenant, principal, roles, model, route, token counts and guardrail
findings. Its answer is either a boolean (allow) or an object
``{"allow": bool, "reasons": [str, ...]}`` (``"deny": [...]`` is read as
reasons too). Anything else, an undefined result included, is a deny: the
default is to refuse.

Embedded policies are compiled when the policy (version) is loaded (and once
more by each evaluating thread; ``rego``). A tenant's embedded policy is
evaluated on a small thread pool of its own, its timeout counted in the
evaluating thread's CPU time (``opa_watchdog``).
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
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from inferflux.policy.guardrails.errors import OpaError, PolicyDenied, PolicyEngineUnavailable
from inferflux.policy.guardrails.findings import Finding
from inferflux.policy.guardrails.opa_cache import DecisionCache, cacheable_fields
from inferflux.policy.guardrails.opa_watchdog import Watchdog
from inferflux.policy.guardrails.rego import compile_rego, entrypoint, load_regopy, prepare_input
from inferflux.policy.guardrails.rego_input import expressions, query
from inferflux.policy.guardrails.spec import OpaEngine, OpaSettings
from inferflux.policy.rbac import Principal

log = logging.getLogger("inferflux.guardrails.opa")

MAX_REASONS = 10
MAX_REASON_LENGTH = 300
Verdict = tuple[bool, tuple[str, ...]]  # a policy's answer: allowed, and its reasons


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


def interpret(result: Any, *, defined: bool = True) -> Verdict:
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

    async def _evaluate(self, document: Mapping[str, Any]) -> Verdict:
        raise NotImplementedError

    async def _evaluate_in_time(self, document: Mapping[str, Any]) -> Verdict:
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
        self._entrypoint_bytes = entrypoint(settings.query).encode()
        self._local = threading.local()
        self._local.compiled = compile_rego(self._rego, self._query)  # a bad policy fails here, not on a request
        self.inline = inline
        # decide_now's interpreter, compiled here so that no request's thread compiles;
        # a second thread deciding meanwhile uses its own (``_compiled``).
        self._inline_compiled = compile_rego(self._rego, self._query) if inline else None
        self._inline_lock = threading.Lock()
        self._inline_input: Any = None
        self.cache = DecisionCache(cacheable_fields(self._rego))  # off (None) unless a decision can be reused

    def _compiled(self) -> tuple[Any, Any]:
        compiled = getattr(self._local, "compiled", None)
        if compiled is None:
            compiled = self._local.compiled = compile_rego(self._rego, self._query)
        return compiled

    def evaluate(self, document: Mapping[str, Any], deadline: float | None = None) -> Verdict:
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

    def _evaluate_prepared(self, prepared: Any, deadline: float | None) -> Verdict:
        """The decision for an input made by ``prepare_input``, on the calling thread's own interpreter."""
        if deadline is not None and time.monotonic() > deadline:
            raise OpaError("no time left to evaluate (the gateway is overloaded)")
        compiled = self._compiled()
        self._local.input = prepared  # the interpreter points into it until it gets the next one
        return self._ask(compiled, prepared)

    def _ask(self, compiled: tuple[Any, Any], prepared: Any) -> Verdict:
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

    async def _evaluate_in_time(self, document: Mapping[str, Any]) -> Verdict:
        # On the pool, held to the policy's timeout in the evaluating thread's CPU time (opa_watchdog).
        key = self.cache.key(document)
        remembered = self.cache.get(key)
        if remembered is not None:
            return remembered
        prepared = prepare_input(document)  # plain Python work, done here rather than on the evaluating thread
        decided = await Watchdog(lambda deadline: self._evaluate_prepared(prepared, deadline), self.timeout).result()
        self.cache.put(key, decided)
        return decided


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

    async def _evaluate(self, document: Mapping[str, Any]) -> Verdict:
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
    if settings.engine is OpaEngine.EMBEDDED:
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
