"""A generation request's grammars compiled under the grammar budget, off the event loop, before it is planned.

A request for a local model that constrains its output (``response_format``,
``guided_regex``, ``guided_choice``, a forced tool call) or carries tools has
grammars to build: its ``GuidedSpec`` for the model's vocabulary, and each tool's
``parameters`` (checked in ``auto`` mode too, since a forced call would need it).
A grammar the process has not built before is built first in a grammar worker
(``backends.engine.grammar_sandbox``) under ``grammar.*``'s budget, which the
request's new grammars share (the tools' first, then its constraint): over it, 400
``schema_too_complex`` naming the field; no worker free for
``grammar.queue_seconds``, 503 ``grammar_busy`` (a free worker goes to the tenant
holding the fewest). The wait runs on a thread and
watches the client: when it leaves (or a draining server's grace ends) the worker
is killed at once, and nothing of that grammar runs on. Planning then finds the
grammar compiled (``GrammarCompiler``'s cache) and the tools' verdicts remembered.
A remote model's upstream enforces its constraints: nothing is compiled here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import anyio

from inferflux.backends.engine import EngineError, GrammarTooComplexError, InvalidRequestError

from inferflux.gateway.models.served import ServedModel
from inferflux.gateway.pipeline.generation import engine_error_to_gateway
from inferflux.gateway.pipeline.protocol import ChatCompletionRequest, GenerationRequest, param_names
from inferflux.gateway.pipeline.tools import check_parameters

if TYPE_CHECKING:
    from inferflux.gateway.pipeline.call import Call

T = TypeVar("T")


async def compile_grammars(call: Call, served: ServedModel, req: GenerationRequest) -> None:
    """Build ``req``'s grammars for ``served`` within the app's budget; raises the refusal (400, 503),
    ``ClientDisconnected`` if the client left meanwhile, ``ShuttingDown`` when a drain's grace ended."""
    if served.remote:
        return
    tools = req.tools if isinstance(req, ChatCompletionRequest) else None
    spec = req.guided()
    if not tools and spec is None:
        return
    budget = call.state.grammar_budget  # for all of the request's new grammars together
    names = param_names(req)
    tenant = call.principal.tenant_id  # the workers are shared fairly between tenants
    if tools:
        budget = await _watched(call, partial(check_parameters, tools, budget, owner=tenant), names)
    if spec is not None:
        # Over the budget the field that holds the schema is named; what llguidance cannot compile keeps
        # the constraint's own name, as planning names it.
        over = {**names, "guided": _schema_field(req)}
        await _watched(call, partial(served.engine.compile_grammar, spec, budget, owner=tenant), names, over)


async def _watched(call: Call, work: Callable[..., T], names: dict[str, str],
                   over: dict[str, str] | None = None) -> T:  # fmt: skip
    """``work`` on a thread, given up if the client leaves; the engine's errors as the client's (``over``:
    the parameter names of an error over the budget, if not ``names``)."""
    try:
        return await call.watched(_on_thread(work))
    except GrammarTooComplexError as exc:
        raise engine_error_to_gateway(exc, param_names=over or names) from None
    except (InvalidRequestError, EngineError) as exc:
        raise engine_error_to_gateway(exc, param_names=names) from None


async def _on_thread(work: Callable[..., T]) -> T:
    """``work(cancel=event)`` on a worker thread; the event is set if this is cancelled (the client left), and
    ``work`` stops its grammar worker then. The thread is not waited for: it ends within a poll interval."""
    cancel = threading.Event()
    try:
        return await anyio.to_thread.run_sync(partial(work, cancel=cancel), abandon_on_cancel=True)
    except BaseException:
        cancel.set()
        raise


def _schema_field(req: GenerationRequest) -> str:
    """The field whose grammar ``req.guided()`` is, as a ``schema_too_complex`` names it."""
    param = req.guided_param
    if param == "tool_choice":
        return "tools"  # a forced call's schema is every tool's parameters together
    response_format = req.response_format
    if param == "response_format" and response_format is not None and response_format.type == "json_schema":
        return "response_format.json_schema.schema"
    return param
