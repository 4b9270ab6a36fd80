"""A request body through a tenant's input guardrails: its texts collected, checked, refused or written back.

``screen_body`` is the whole input check of one request (``RequestPolicy.screen``
calls it): the body's texts (``texts.collect``: every string that reaches the
model), checked each alone, as a conversation and in the groups the model
reads as one; a redaction that lands on a text that cannot be rewritten (a
name, a key, a schema's machinery, decoded token ids) refuses the request, as
a block would; otherwise the redacted texts are written back into a copy of the
body.

``screen_off_loop`` runs it on a small pool of its own threads, so that a large
body's check never holds an event loop: a scan is linear in the body's size,
and several megabytes of text take seconds. The pool is small on purpose:
the scans queue behind one another instead of taking every core (and the
GIL) from the rest of the gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from inferflux.policy.guardrails.check import Decision
from inferflux.policy.guardrails.engine import Guardrails
from inferflux.policy.guardrails.errors import InvalidText
from inferflux.policy.guardrails.findings import Action
from inferflux.policy.guardrails.texts import Decode, RequestTexts, collect, with_texts

SCAN_THREADS = 2
# A body up to this size is checked on the calling thread: at most a few milliseconds of scanning (text
# with accents on every letter, the slowest), less than a hand-off to a thread costs a small request in
# waiting for the GIL. Larger ones go to the scan threads.
INLINE_SCAN_BYTES = 4096


@dataclass(frozen=True)
class Screened:
    """The body the rest of the request reads, the texts the audit digests, and what the check decided
    (None: the tenant has no input guardrails)."""

    body: dict[str, Any]
    texts: list[str]
    decision: Decision | None


def screen_body(guards: Guardrails, body: dict[str, Any], decode: Decode | None = None) -> Screened:
    """``body`` through ``guards``' input check; a blocked decision is returned, not raised (the caller
    records its findings first). ``decode``: how to read token ids (None: they cannot be read, and a tenant
    with input guardrails is refused them: ``InvalidText``). Raises ``InvalidText`` for a call's
    arguments holding a lone surrogate, whatever the guardrails."""
    if not guards.checks_input:
        return Screened(body, collect(body).texts, None)
    collected = collect(body, decode or _undecodable)
    decision = _unrewritable_refused(guards.check_input(collected.texts, collected.groups), collected)
    if decision.blocked or not decision.redacted:
        return Screened(body, collected.texts, decision)
    return Screened(with_texts(body, decision.texts, collected), list(decision.texts), decision)


def _undecodable(ids: Any) -> str | None:
    raise InvalidText("This tenant's input guardrails read text, and token ids cannot be decoded for this "
                      "model here: send the input as text", code="token_ids_unchecked")  # fmt: skip


def _unrewritable_refused(decision: Decision, collected: RequestTexts) -> Decision:
    """``decision`` with every redaction of a fixed text turned into a block: such a text (a tool's name, a
    property name, a pattern, decoded token ids) cannot be rewritten without changing what it means."""
    if not decision.redacted or not any(f.index in collected.fixed for f in decision.findings):
        return decision
    findings = tuple(
        dataclasses.replace(f, action=Action.BLOCK) if f.action is Action.REDACT and f.index in collected.fixed else f
        for f in decision.findings
    )
    return Decision(blocked=True, texts=tuple(collected.texts), findings=findings)


_pool: ThreadPoolExecutor | None = None


async def screen(guards: Guardrails, body: dict[str, Any], size: int, decode: Decode | None = None) -> Screened:
    """``screen_body``, on this thread for a body of ``size`` bytes up to ``INLINE_SCAN_BYTES``, else on
    the scan threads (awaited: the event loop serves other requests meanwhile)."""
    if size <= INLINE_SCAN_BYTES:
        return screen_body(guards, body, decode)
    return await screen_off_loop(guards, body, decode)


async def screen_off_loop(guards: Guardrails, body: dict[str, Any], decode: Decode | None = None) -> Screened:
    """``screen_body`` on the scan threads, awaited."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="guardrail-scan")
    return await asyncio.get_running_loop().run_in_executor(_pool, screen_body, guards, body, decode)
