"""The request path's driver: an API call's stages, called in the order it meets them, each inside its trace stage.

A generation (``generate``: chat and text completions) reads top to bottom:
body → schemas → policy 1 → parse → allow-list → policy 2 → grammars → plan →
policy 3 → generate → render. Every stage gets the ``Call`` (built here, once),
not the request, and none opens a trace stage of its own: the ones named in
``gateway.tracing`` are opened here, around the steps that make them.
``RequestPolicy`` (``gateway.pipeline.policy``) decides; its docstring holds the
refusal order, and ``start`` below calls its steps in that order. The Responses
and Messages APIs (``adapted``) turn the vendor's body into a chat body that
takes the chat path's two halves (``prepare``, ``answer``), and the chat answer
back into the vendor's shape. An embeddings request (``embeddings``) takes the
same stages but the grammars and the engine's start. docs/architecture.md
("A chat completion's path") lists these stages with their modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferflux.gateway.metrics import CLIENT_CLOSED_STATUS
from inferflux.gateway.models.served import ServedModel
from inferflux.gateway.pipeline.adapters import Adapter, AdapterRenderer
from inferflux.gateway.pipeline.body import check_schemas, read_body
from inferflux.gateway.pipeline.call import Call
from inferflux.gateway.pipeline.embeddings import embed, embedding_settings, parse_embeddings, plan_embeddings
from inferflux.gateway.pipeline.embeddings import render_embeddings
from inferflux.gateway.pipeline.generation import ChoiceEvent, Generation
from inferflux.gateway.pipeline.grammars import compile_grammars
from inferflux.gateway.pipeline.plan import Placement, Plan, plan_chat, plan_completion
from inferflux.gateway.pipeline.plan_remote import plan_remote
from inferflux.gateway.pipeline.policy import RequestPolicy, Work
from inferflux.gateway.pipeline.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest, parse_request
from inferflux.gateway.pipeline.render import ChatRenderer, CompletionRenderer, Renderer, collect, sse_body
from inferflux.gateway.pipeline.sse import ClientDisconnected, SSEResponse
from inferflux.gateway.tracing import stage
from inferflux.policy.errors import ApiError
from inferflux.policy.ratelimit import Admission

Req = TypeVar("Req", ChatCompletionRequest, CompletionRequest)

# A body this small is templated and tokenised on the event loop: a few hundred
# microseconds at most, less than a hop to the thread pool and back costs on a
# busy machine (measured: benchmarks/bench_policy.py); a larger one is planned
# on the pool so that it cannot stall every other request.
INLINE_PLAN_BYTES = 1024

CONCURRENT = {"inferflux.concurrent": True}  # a stage that runs beside another (gateway.tracing)


@dataclass(frozen=True)
class Api(Generic[Req]):
    """What differs between the generation APIs: the body's model, how it is planned, how answered."""

    request: type[Req]
    plan: Callable[[ServedModel, Req, Placement], Plan]
    render: Callable[[Plan, Req], Renderer]


CHAT = Api(ChatCompletionRequest, plan_chat, lambda plan, req: ChatRenderer(plan, req.logprobs))
COMPLETION = Api(CompletionRequest, plan_completion,
                 lambda plan, req: CompletionRenderer(plan, req.logprobs, req.echo, req.n))  # fmt: skip


async def generate(request: Request, api: Api[Req]) -> Response:
    """A chat or text completion, from its body to its answer."""
    call = Call.of(request)
    policy = RequestPolicy(call, call.state.traffic)
    body = await _body(call)
    try:
        req, plan = await prepare(call, policy, body, api.request, api.plan)
    except ClientDisconnected:  # while its grammars compiled
        return Response(status_code=CLIENT_CLOSED_STATUS)
    return await answer(call, policy, plan, req, api.render(plan, req))


async def _body(call: Call) -> dict[str, Any]:
    with stage(call.ctx, "read_body"):
        return await read_body(call.headers.get("content-type"), call.body, call.state.json_limits)


async def prepare(call: Call, policy: RequestPolicy, body: dict[str, Any], kind: type[Req],
                  plan_for: Callable[[ServedModel, Req, Placement], Plan]) -> tuple[Req, Plan]:  # fmt: skip
    """The generation's checked plan: the size of its schemas, input guardrails on ``body`` (policy 1), parse,
    allow-list, placement (policy 2), its grammars compiled within their budget, plan."""
    check_schemas(body, call.state.schema_limits)  # before any guardrail or grammar work
    with stage(call.ctx, "guardrails.input"):
        body = await policy.screen(body)
    with stage(call.ctx, "plan"):
        req = parse_request(kind, body, call.state.stop_limits)
        served = call.model(req.model)
        placement = await policy.place(req)
        if served.remote:  # no tokenizer to run: an upstream serves it
            plan_for = plan_remote  # type: ignore[assignment]
        await compile_grammars(call, served, req)  # in a grammar worker first, given up if the client leaves
        # Planning finds them compiled (the model's first guided request builds its vocabulary, ~0.5 s).
        if len(await call.body()) <= INLINE_PLAN_BYTES and req.guided() is None:
            return req, plan_for(served, req, placement)
        return req, await run_in_threadpool(plan_for, served, req, placement)


async def answer(call: Call, policy: RequestPolicy, plan: Plan, req: GenerationRequest, render: Renderer) -> Response:
    """The generation's answer (policy 3 first): one JSON body, or an SSE stream once its first output is
    there (the chat stream's chunks, or an adapter's events made of them)."""
    if not req.stream:
        try:
            gen = await start(call, policy, plan)
            async with gen:  # closed, and so settled (policy 4), when the block ends
                outputs = await call.watched(collect(gen))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return JSONResponse(render.full(outputs, gen.usage), headers=policy.headers)
    gen = await start(call, policy, plan)
    try:
        # Wait for the first output before sending headers, so that admission
        # errors (prompt too long, overload) still get their real status.
        first = await call.watched(_first_event(gen))
    except ClientDisconnected:
        await gen.close()
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except BaseException:
        await gen.close()
        raise
    if isinstance(render, AdapterRenderer):
        return SSEResponse(render.sse_body(gen, first), on_close=gen.close, headers=policy.headers,
                           error_end=render.adapter.error_end)  # fmt: skip
    return SSEResponse(sse_body(gen, first, render, req.include_usage), on_close=gen.close, headers=policy.headers)


async def _first_event(gen: Generation) -> ChoiceEvent | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


# -- policy 3, each step inside its trace stage, in the refusal order of RequestPolicy's docstring


async def start(call: Call, policy: RequestPolicy, plan: Plan) -> Generation:
    """The request's ``Generation``, started once every policy allows it; raises the first refusal."""
    work = Work.of(plan)
    admission = await _admitted(call, policy, work)
    gen: Generation | None = None
    try:
        if policy.decides_inline:
            with stage(call.ctx, "opa"):
                policy.authorize_inline(work)  # before the engine gets it
        gen = policy.generation(plan, admission)
        # The engine starts, the awaited policies decide while it works, and none of
        # its output goes out before they allow.
        gen.start()
        if policy.decides_deferred:
            with stage(call.ctx, "opa", **CONCURRENT):
                await policy.authorize_deferred(work)
    except BaseException:
        await policy.refund(admission, gen)
        raise
    policy.admitted(admission)
    return gen


async def _admitted(call: Call, policy: RequestPolicy, work: Work) -> Admission:
    """3a: the engine's queue, then the limits; a request refused here is first put to every OPA policy."""
    try:
        with stage(call.ctx, "limits"):
            return await policy.admit(work)
    except ApiError:
        await _authorized(call, policy, work)  # a policy's refusal answers first
        raise


async def _authorized(call: Call, policy: RequestPolicy, work: Work) -> None:
    """Every OPA policy's decision at once (none decides: nothing to ask)."""
    if policy.decides:
        with stage(call.ctx, "opa"):
            await policy.authorize_all(work)


# -- the Responses and Messages APIs: adapters over the chat path


async def adapted(request: Request, parse: Callable[[dict[str, Any]], Adapter]) -> Response:
    """The vendor's body as a chat body, through the chat path's own steps; its answer in the vendor's shape.
    An error past the translation names the vendor's field (``stop[1]`` is ``stop_sequences[1]``)."""
    call = Call.of(request)
    policy = RequestPolicy(call, call.state.traffic)
    adapter = parse(await _body(call))
    try:
        req, plan = await prepare(call, policy, adapter.chat_body(), ChatCompletionRequest, plan_chat)
        return await answer(call, policy, plan, req, AdapterRenderer(plan, adapter))
    except ClientDisconnected:  # while its grammars compiled
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except ApiError as exc:
        chat_param, exc.param = exc.param, adapter.param(exc.param)
        if chat_param and exc.param != chat_param and exc.message.startswith(f"{chat_param}:"):
            exc.message = f"{exc.param}{exc.message[len(chat_param):]}"  # "stop[1]: ..." -> "stop_sequences[1]: ..."
        raise


# -- embeddings


async def embeddings(request: Request) -> Response:
    """body → policy 1 → parse → allow-list → plan → policy 3 (the queue, the limits, every OPA policy at
    once) → embed → policy 4 → render."""
    call = Call.of(request)
    policy = RequestPolicy(call, call.state.traffic)
    body = await _body(call)
    with stage(call.ctx, "guardrails.input"):
        body = await policy.screen(body)
    req = parse_embeddings(body)
    served = call.model(req.model)
    args = (served, req, embedding_settings(served, call.state.settings), call.principal.tenant_id,
            policy.upstream_headers())  # fmt: skip
    small = len(await call.body()) <= INLINE_PLAN_BYTES  # tokenised on the loop, as a generation's plan
    plan = plan_embeddings(*args) if small else await run_in_threadpool(plan_embeddings, *args)
    work = policy.embedding_work(plan)
    admission = await _admitted(call, policy, work)
    try:
        await _authorized(call, policy, work)
    except BaseException:
        await policy.refund(admission)  # refused: none of its tokens count
        raise
    policy.admitted(admission)
    used = 0  # the tokens the model counted, settled whatever happens next
    try:
        with stage(call.ctx, "embed"):
            result = await call.watched(embed(plan))
        used = result.prompt_tokens
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    finally:
        policy.settle(plan.served.name, admission, used, 0)
    return JSONResponse(render_embeddings(plan, result), headers=policy.headers)
