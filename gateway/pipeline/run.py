"""The request path's driver: an API call's stages, called in the order it meets them, each inside its trace stage.

A generation (``generate``: chat and text completions) reads top to bottom:
body → policy 1 → parse → policy 2 → plan → policy 3 → the answer. ``generate``
reads the call and its body, ``complete`` takes it from there; every stage gets
the ``Call`` (built here, once), not the request, and none opens a trace stage
of its own: the ones named in ``gateway.tracing`` are opened here, around the
steps that make them. ``RequestPolicy`` (``gateway.pipeline.policy``) decides;
its docstring holds the refusal order, and ``complete`` calls its steps in that
order. The Responses and Messages APIs (``adapted``) turn the vendor's body into
a chat body that ``complete`` takes, and the chat answer back into the vendor's
shape; Anthropic's token count (``count_tokens``) takes the Messages body as far as
its prompt's tokens, and the policy steps that do not start the engine. An
embeddings request (``embeddings``) takes the same stages but the grammars and
the engine's start. docs/architecture.md ("A chat completion's
path") lists every function this path enters, with its module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferflux.gateway.metrics import CLIENT_CLOSED_STATUS
from inferflux.gateway.models.served import ServedModel
from inferflux.gateway.pipeline.adapters import Adapter, AdapterRenderer, parse_count_tokens
from inferflux.gateway.pipeline.body import check_schemas, read_body
from inferflux.gateway.pipeline.call import Call
from inferflux.gateway.pipeline.embeddings import embed, embedding_settings, parse_embeddings, plan_embeddings
from inferflux.gateway.pipeline.embeddings import render_embeddings
from inferflux.gateway.pipeline.plan import INLINE_PLAN_BYTES, Placement, Plan, count_chat, plan_chat, plan_completion
from inferflux.gateway.pipeline.plan import plan_request
from inferflux.gateway.pipeline.plan_remote import plan_remote
from inferflux.gateway.pipeline.policy import RequestPolicy, allowed_model
from inferflux.gateway.pipeline.protocol import ChatCompletionRequest, CompletionRequest, Req, parse_request
from inferflux.gateway.pipeline.render import ChatRenderer, CompletionRenderer, Renderer, respond
from inferflux.gateway.pipeline.sse import ClientDisconnected
from inferflux.gateway.tracing import stage
from inferflux.policy.errors import ApiError

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
    """A chat or text completion, from its body (its schemas' size checked with it) to its answer."""
    call = Call.of(request)
    with stage(call.ctx, "read_body"):
        body = await read_body(call.headers.get("content-type"), call.body, call.state.json_limits,
                               call.state.schema_limits)  # fmt: skip
    return await complete(call, body, api)


async def complete(call: Call, body: dict[str, Any], api: Api[Req]) -> Response:
    """A generation from its decoded ``body``: policy 1, parse, policy 2, plan, policy 3 (each step in the
    refusal order of ``RequestPolicy``'s docstring), then the answer."""
    policy = RequestPolicy(call, call.state.traffic)
    with stage(call.ctx, "guardrails.input"):
        body = await policy.screen(body)
    try:
        with stage(call.ctx, "plan"):
            req = parse_request(api.request, body, call.state.stop_limits)
            served, placement = await policy.place(req)
            plan_for = plan_remote if served.remote else api.plan  # a remote model: no tokenizer to run
            plan = await plan_request(call, served, req, placement, plan_for)
    except ClientDisconnected:  # while its grammars compiled
        return Response(status_code=CLIENT_CLOSED_STATUS)
    try:  # 3a; a request refused here is first put to every OPA policy, whose refusal answers instead
        with stage(call.ctx, "limits"):
            await policy.admit(plan)
    except ApiError:
        if policy.decides:
            with stage(call.ctx, "opa"):
                await policy.authorize_all()
        raise
    try:
        if policy.decides_inline:  # 3b, before the engine gets the request
            with stage(call.ctx, "opa"):
                policy.authorize_inline()
        # 3c: the engine starts, the awaited policies decide while it works, and
        # none of its output goes out before they allow.
        gen = policy.generation(plan)
        if policy.decides_deferred:
            with stage(call.ctx, "opa", **CONCURRENT):
                await policy.authorize_deferred()
    except BaseException:
        await policy.refund()
        raise
    return await respond(call, gen, api.render(plan, req), req, policy.headers)


# -- the Responses and Messages APIs: adapters over the chat path


async def adapted(request: Request, parse: Callable[[dict[str, Any]], Adapter]) -> Response:
    """The vendor's body as a chat body, through the chat path's own steps; its answer in the vendor's shape.
    An error past the translation names the vendor's field (``stop[1]`` is ``stop_sequences[1]``)."""
    call = Call.of(request)
    with stage(call.ctx, "read_body"):  # its schemas' size is the chat body's, checked once translated
        vendor_body = await read_body(call.headers.get("content-type"), call.body, call.state.json_limits, None)
    adapter = parse(vendor_body)
    api = Api(ChatCompletionRequest, plan_chat, lambda plan, _: AdapterRenderer(plan, adapter))
    try:
        body = adapter.chat_body()
        check_schemas(body, call.state.schema_limits)
        return await complete(call, body, api)
    except ApiError as exc:
        _rename(exc, adapter)
        raise


def _rename(exc: ApiError, adapter: Adapter) -> None:
    """``exc`` made to name the vendor's field where it named the chat body's."""
    chat_param, exc.param = exc.param, adapter.param(exc.param)
    if chat_param and exc.param != chat_param and exc.message.startswith(f"{chat_param}:"):
        exc.message = f"{exc.param}{exc.message[len(chat_param):]}"  # "stop[1]: ..." -> "stop_sequences[1]: ..."


async def count_tokens(request: Request) -> Response:
    """Anthropic's token count: body → policy 1 → parse → allow-list → the prompt templated and tokenised as
    ``/v1/messages`` would → policy 3 (one request to the limits with no tokens, every OPA policy at once) →
    policy 4 (nothing used) → ``{"input_tokens": N}``. Nothing reaches the engine."""
    call = Call.of(request)
    policy = RequestPolicy(call, call.state.traffic)
    with stage(call.ctx, "read_body"):
        vendor_body = await read_body(call.headers.get("content-type"), call.body, call.state.json_limits, None)
    adapter = parse_count_tokens(vendor_body)
    try:
        body = adapter.chat_body()
        check_schemas(body, call.state.schema_limits)
        with stage(call.ctx, "guardrails.input"):
            body = await policy.screen(body)
        with stage(call.ctx, "plan"):
            req = parse_request(ChatCompletionRequest, body, call.state.stop_limits)
            served = allowed_model(call, req.model)
            small = len(await call.body()) <= INLINE_PLAN_BYTES  # templated on the loop, as a small plan is
            tokens = count_chat(served, req) if small else await run_in_threadpool(count_chat, served, req)
    except ApiError as exc:
        _rename(exc, adapter)
        raise
    try:
        with stage(call.ctx, "limits"):
            await policy.admit_count(served, tokens)
    except ApiError:
        await _authorized(call, policy)  # a policy's refusal answers first
        raise
    try:
        await _authorized(call, policy)
    finally:
        policy.settle(served.name, 0, 0)  # the request counted; no tokens were used
    return JSONResponse({"input_tokens": tokens}, headers=policy.headers)


# -- embeddings


async def embeddings(request: Request) -> Response:
    """body → policy 1 → parse → allow-list → plan → policy 3 (the queue, the limits, every OPA policy at
    once) → embed → policy 4 → render."""
    call = Call.of(request)
    policy = RequestPolicy(call, call.state.traffic)
    with stage(call.ctx, "read_body"):
        body = await read_body(call.headers.get("content-type"), call.body, call.state.json_limits, None)
    with stage(call.ctx, "guardrails.input"):
        body = await policy.screen(body)
    req = parse_embeddings(body)
    served = allowed_model(call, req.model)
    args = (served, req, embedding_settings(served, call.state.settings), call.principal.tenant_id,
            policy.upstream_headers())  # fmt: skip
    small = len(await call.body()) <= INLINE_PLAN_BYTES  # tokenised on the loop, as a generation's plan
    plan = plan_embeddings(*args) if small else await run_in_threadpool(plan_embeddings, *args)
    try:
        with stage(call.ctx, "limits"):
            await policy.admit(plan)
    except ApiError:
        await _authorized(call, policy)  # a policy's refusal answers first
        raise
    try:
        await _authorized(call, policy)
    except BaseException:
        await policy.refund()  # refused: none of its tokens count
        raise
    used = 0  # the tokens the model counted, settled whatever happens next
    try:
        with stage(call.ctx, "embed"):
            result = await call.watched(embed(plan))
        used = result.prompt_tokens
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    finally:
        policy.settle(plan.served.name, used, 0)
    return JSONResponse(render_embeddings(plan, result), headers=policy.headers)


async def _authorized(call: Call, policy: RequestPolicy) -> None:
    """Every OPA policy's decision at once (none decides: nothing to ask)."""
    if policy.decides:
        with stage(call.ctx, "opa"):
            await policy.authorize_all()
