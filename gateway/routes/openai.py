"""OpenAI-compatible routes: chat completions, completions, embeddings, models; the Responses and Messages APIs
(and the Messages API's token count).

Each API call's handler is one line: its stages are the pipeline's
(``gateway.pipeline``), called in order by its driver (``gateway.pipeline.run``),
which docs/architecture.md follows stage by stage. What is left here is each
route's declaration (its OpenAPI entry, its scope) and the model listing.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.authz import requires
from inferflux.gateway.models.served import ServedModel
from inferflux.gateway.openapi import document
from inferflux.gateway.pipeline import run
from inferflux.gateway.pipeline.adapters import CountTokensRequest, MessagesRequest, ResponsesRequest, parse_messages
from inferflux.gateway.pipeline.adapters import parse_responses
from inferflux.gateway.pipeline.call import Call
from inferflux.gateway.pipeline.embeddings import EmbeddingsRequest
from inferflux.gateway.pipeline.policy import allowed_model
from inferflux.gateway.pipeline.protocol import ChatCompletionRequest, CompletionRequest
from inferflux.policy.rbac import Scope

# -- generation ---------------------------------------------------------------


@document("Chat completion (OpenAI-compatible; SSE when stream is true)", tag="openai", body=ChatCompletionRequest, streams=True)
@requires(Scope.GENERATE)
async def chat_completions(request: Request) -> Response:
    return await run.generate(request, run.CHAT)


@document("Text completion (OpenAI-compatible; SSE when stream is true)", tag="openai", body=CompletionRequest, streams=True)
@requires(Scope.GENERATE)
async def completions(request: Request) -> Response:
    return await run.generate(request, run.COMPLETION)


# -- the Responses and Messages APIs: adapters over the chat path ------------------------


@document("Response (OpenAI's Responses API, stateless subset; SSE events when stream is true)", tag="openai",
          body=ResponsesRequest, streams=True)  # fmt: skip
@requires(Scope.GENERATE)
async def responses(request: Request) -> Response:
    return await run.adapted(request, parse_responses)


@document("Message (Anthropic's Messages API; SSE events when stream is true)", tag="openai", body=MessagesRequest,
          streams=True)  # fmt: skip
@requires(Scope.GENERATE)
async def messages(request: Request) -> Response:
    return await run.adapted(request, parse_messages)


@document("Token count of a message's prompt (Anthropic's count_tokens; nothing is generated)", tag="openai",
          body=CountTokensRequest)  # fmt: skip
@requires(Scope.GENERATE)
async def count_tokens(request: Request) -> Response:
    return await run.count_tokens(request)


# -- embeddings -----------------------------------------------------------------


@document("Embeddings of strings or token ids (OpenAI-compatible)", tag="openai", body=EmbeddingsRequest)
@requires(Scope.GENERATE)
async def embeddings(request: Request) -> Response:
    return await run.embeddings(request)


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
    call = Call.of(request)
    cards = [_model_card(m) for m in call.state.manager.list() if call.principal.may_use_model(m.name)]
    return JSONResponse({"object": "list", "data": cards})


@document("One model, by name or alias", tag="openai")
@requires(Scope.READ)
async def retrieve_model(request: Request) -> Response:
    return JSONResponse(_model_card(allowed_model(Call.of(request), request.path_params["model_id"])))


def routes() -> list[BaseRoute]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        # :path so ids containing "/" (e.g. "org/model") resolve.
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    ]
