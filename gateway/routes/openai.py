"""OpenAI-compatible routes: chat completions, completions, embeddings, models; the Responses and Messages APIs.

A generation handler reads top to bottom: parse → plan → policy → generate →
render. The body is decoded with limits (``gateway.pipeline.body``), its schemas and
tools measured against theirs (``gateway.pipeline.schema_limits``), and screened by
the input guardrails before it is parsed (a redacting rule rewrites what is
parsed); its grammars are compiled under the grammar budget (``gateway.pipeline.grammars``);
``gateway.pipeline.plan`` turns the request into checked engine requests
(``gateway.pipeline.plan_remote`` into upstream requests, for a model an upstream serves);
``gateway.pipeline.policy.RequestPolicy`` owns admission, limits, OPA and
settlement, in its one refusal order; ``gateway.pipeline.render`` shapes the answer.
The embeddings handler reads the same way (``gateway.pipeline.embeddings`` parses,
plans, runs and renders; the same ``RequestPolicy`` decides). ``/v1/responses``
and ``/v1/messages`` are adapters (``gateway.pipeline.adapters``): the vendor's body
becomes a chat body that takes the chat route's steps (``_prepare``,
``_answer``), and the chat answer goes back in the vendor's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.pipeline.adapters import Adapter, AdapterRenderer, MessagesRequest, ResponsesRequest, parse_messages
from inferflux.gateway.pipeline.adapters import parse_responses
from inferflux.gateway.authz import principal_of, requires
from inferflux.gateway.context import get_context
from inferflux.gateway.pipeline.embeddings import EmbeddingsRequest, embed, embedding_settings, parse_embeddings, plan_embeddings
from inferflux.gateway.pipeline.embeddings import render_embeddings
from inferflux.gateway.errors import ModelNotFound, UnsupportedMediaType
from inferflux.gateway.pipeline.generation import ChoiceEvent, Generation
from inferflux.gateway.pipeline.grammars import compile_grammars
from inferflux.gateway.pipeline.body import decode_json_body
from inferflux.gateway.metrics import CLIENT_CLOSED_STATUS
from inferflux.gateway.models import ModelManager, ServedModel
from inferflux.gateway.openapi import document
from inferflux.gateway.pipeline.plan import GenerationRequest, Placement, Plan, plan_chat, plan_completion
from inferflux.gateway.pipeline.plan_remote import plan_remote
from inferflux.gateway.pipeline.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from inferflux.gateway.pipeline.render import ChatRenderer, CompletionRenderer, Renderer, collect, sse_body
from inferflux.gateway.pipeline.policy import RequestPolicy
from inferflux.gateway.pipeline.schema_limits import check_schemas
from inferflux.gateway.state import state_of
from inferflux.gateway.pipeline.sse import ClientDisconnected, SSEResponse, drain_deadline, run_until_disconnect
from inferflux.gateway.tracing import stage
from inferflux.policy.errors import ApiError
from inferflux.policy.rbac import Scope

Req = TypeVar("Req", ChatCompletionRequest, CompletionRequest)

# A body this small is templated and tokenised on the event loop: a few hundred
# microseconds at most, less than a hop to the thread pool and back costs on a
# busy machine (measured: benchmarks/bench_policy.py); a larger one is planned
# on the pool so that it cannot stall every other request.
INLINE_PLAN_BYTES = 1024


async def read_json(request: Request) -> dict[str, Any]:
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type must be application/json, not {media_type or 'empty'!r}")
    with stage(get_context(request), "read_body"):
        return decode_json_body(await request.body(), state_of(request).json_limits)


def _manager(request: Request) -> ModelManager:
    return state_of(request).manager


def _resolve(request: Request, name: str) -> ServedModel:
    """The served model, if this caller may use it; otherwise the same 404 as a missing one."""
    served = _manager(request).get(name)
    if not principal_of(request).may_use_model(served.name):
        raise ModelNotFound(name)
    get_context(request).model = served.name
    return served


# -- generation ---------------------------------------------------------------


@document("Chat completion (OpenAI-compatible; SSE when stream is true)", tag="openai", body=ChatCompletionRequest, streams=True)
@requires(Scope.GENERATE)
async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, plan_chat, lambda plan, req: ChatRenderer(plan, req.logprobs))


@document("Text completion (OpenAI-compatible; SSE when stream is true)", tag="openai", body=CompletionRequest, streams=True)
@requires(Scope.GENERATE)
async def completions(request: Request) -> Response:
    return await _generate(request, CompletionRequest, plan_completion,
                           lambda plan, req: CompletionRenderer(plan, req.logprobs, req.echo, req.n))  # fmt: skip


async def _generate(
    request: Request,
    kind: type[Req],
    plan_for: Callable[[ServedModel, Req, Placement], Plan],
    render_for: Callable[[Plan, Req], Renderer],
) -> Response:
    """parse → plan → policy → generate → render (the policy's steps in its refusal order)."""
    policy = RequestPolicy(request)
    try:
        req, plan = await _prepare(request, policy, await read_json(request), kind, plan_for)
    except ClientDisconnected:  # while its grammars compiled
        return Response(status_code=CLIENT_CLOSED_STATUS)
    return await _answer(request, policy, plan, req, render_for(plan, req))


async def _prepare(
    request: Request,
    policy: RequestPolicy,
    body: dict[str, Any],
    kind: type[Req],
    plan_for: Callable[[ServedModel, Req, Placement], Plan],
) -> tuple[Req, Plan]:
    """The generation's checked plan: the size of its schemas, input guardrails on ``body``, parse,
    allow-list, placement, its grammars compiled within their budget, plan."""
    check_schemas(body, state_of(request).schema_limits)  # before any guardrail or grammar work
    body = await policy.screen(body)
    with stage(policy.ctx, "plan"):
        req = parse_request(kind, body, state_of(request).stop_limits)
        served = _resolve(request, req.model)
        placement = await policy.place(req)
        if served.remote:  # no tokenizer to run: an upstream serves it
            plan_for = plan_remote  # type: ignore[assignment]
        await compile_grammars(request, served, req)  # in a grammar worker first, given up if the client leaves
        # Planning finds them compiled (the model's first guided request builds its vocabulary, ~0.5 s).
        if len(await request.body()) <= INLINE_PLAN_BYTES and req.guided() is None:
            return req, plan_for(served, req, placement)
        return req, await run_in_threadpool(plan_for, served, req, placement)


async def _answer(
    request: Request, policy: RequestPolicy, plan: Plan, req: GenerationRequest, render: Renderer
) -> Response:
    """The generation's answer: one JSON body, or an SSE stream once its first output is there
    (the chat stream's chunks, or an adapter's events made of them)."""
    deadline = drain_deadline(request.scope)
    if not req.stream:
        try:
            async with policy.generating(plan) as gen:
                outputs = await run_until_disconnect(request.receive, collect(gen), deadline)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return JSONResponse(render.full(outputs, gen.usage), headers=policy.headers)
    gen = await policy.start(plan)
    try:
        # Wait for the first output before sending headers, so that admission
        # errors (prompt too long, overload) still get their real status.
        first = await run_until_disconnect(request.receive, _first_event(gen), deadline)
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


# -- the Responses and Messages APIs: adapters over the chat path ------------------------


@document("Response (OpenAI's Responses API, stateless subset; SSE events when stream is true)", tag="openai",
          body=ResponsesRequest, streams=True)  # fmt: skip
@requires(Scope.GENERATE)
async def responses(request: Request) -> Response:
    return await _adapt(request, parse_responses)


@document("Message (Anthropic's Messages API; SSE events when stream is true)", tag="openai", body=MessagesRequest,
          streams=True)  # fmt: skip
@requires(Scope.GENERATE)
async def messages(request: Request) -> Response:
    return await _adapt(request, parse_messages)


async def _adapt(request: Request, parse: Callable[[dict[str, Any]], Adapter]) -> Response:
    """The vendor's body as a chat body, through the chat route's own steps; its answer in the vendor's shape.
    An error past the translation names the vendor's field (``stop[1]`` is ``stop_sequences[1]``)."""
    policy = RequestPolicy(request)
    adapter = parse(await read_json(request))
    try:
        req, plan = await _prepare(request, policy, adapter.chat_body(), ChatCompletionRequest, plan_chat)
        return await _answer(request, policy, plan, req, AdapterRenderer(plan, adapter))
    except ClientDisconnected:  # while its grammars compiled
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except ApiError as exc:
        chat_param, exc.param = exc.param, adapter.param(exc.param)
        if chat_param and exc.param != chat_param and exc.message.startswith(f"{chat_param}:"):
            exc.message = f"{exc.param}{exc.message[len(chat_param):]}"  # "stop[1]: ..." -> "stop_sequences[1]: ..."
        raise


# -- embeddings -----------------------------------------------------------------


@document("Embeddings of strings or token ids (OpenAI-compatible)", tag="openai", body=EmbeddingsRequest)
@requires(Scope.GENERATE)
async def embeddings(request: Request) -> Response:
    """parse → plan → policy → embed → render (the policy's steps in its refusal order)."""
    policy = RequestPolicy(request)
    body = await policy.screen(await read_json(request))
    req = parse_embeddings(body)
    served = _resolve(request, req.model)
    args = (served, req, embedding_settings(served, state_of(request).settings), policy.principal.tenant_id,
            policy.upstream_headers())  # fmt: skip
    small = len(await request.body()) <= INLINE_PLAN_BYTES  # tokenised on the loop, as a generation's plan
    plan = plan_embeddings(*args) if small else await run_in_threadpool(plan_embeddings, *args)
    try:
        async with policy.embedding(plan) as use:
            with stage(policy.ctx, "embed"):
                result = await run_until_disconnect(request.receive, embed(plan), drain_deadline(request.scope))
            use.prompt_tokens = result.prompt_tokens
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    return JSONResponse(render_embeddings(plan, result), headers=policy.headers)


# -- models -------------------------------------------------------------------


def _model_card(served: ServedModel) -> dict[str, Any]:
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "inferflux",
        # Extensions; OpenAI clients ignore unknown fields.
        "aliases": list(served.aliases),
        "context_length": served.max_model_len or None,  # None: an upstream's, not advertised
        "backend": served.backend,
        "capabilities": served.capabilities,  # the routes it serves: chat, completions, embeddings
    }


@document("The models this caller may use", tag="openai")
@requires(Scope.READ)
async def list_models(request: Request) -> Response:
    principal = principal_of(request)
    cards = [_model_card(m) for m in _manager(request).list() if principal.may_use_model(m.name)]
    return JSONResponse({"object": "list", "data": cards})


@document("One model, by name or alias", tag="openai")
@requires(Scope.READ)
async def retrieve_model(request: Request) -> Response:
    return JSONResponse(_model_card(_resolve(request, request.path_params["model_id"])))


def routes() -> list[BaseRoute]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        # :path so ids containing "/" (e.g. "org/model") resolve.
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    ]
