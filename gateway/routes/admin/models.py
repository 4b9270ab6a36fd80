"""Served models (``admin:platform``): load in the background, watch the progress, unload, pick the default.

The work is ``gateway.models.admin.ModelAdmin``'s; these routes parse, check
and record it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.state import state_of
from inferflux.gateway.authz import principal_of, requires
from inferflux.gateway.openapi import document
from inferflux.gateway.routes.admin.common import BODY, PREFIX, NoBody, ok, parse_body, parse_optional_body, record_change
from inferflux.gateway.settings import EmbeddingSettings
from inferflux.gateway.settings.engine import PassesSettings
from inferflux.policy.rbac import Scope


class ModelLoadRequest(BaseModel):
    model_config = BODY
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    path: str | None = Field(default=None, min_length=1,
                             description="A GGUF file or a safetensors directory on the server (a local model)")
    backend: str | None = Field(default=None, description="Registered backend name; default from settings")
    dtype: str | None = Field(default=None, pattern=r"^(auto|float32|bfloat16)$")
    aliases: list[str] = Field(default_factory=list)
    default: bool = False
    upstream: dict[str, Any] | None = Field(
        default=None,
        description="Serve from remote OpenAI-compatible servers (backend 'openai'): endpoints, model, "
        "credential or api_key_env, timeout_seconds, idle_timeout_seconds, max_inflight_per_endpoint, retries, "
        "routing, context_length",
    )
    embedding: EmbeddingSettings | None = Field(
        default=None,
        description="How a local model answers /v1/embeddings, as a configuration file's models[].embedding: "
        "pooling (mean|last), normalize, matryoshka, token_ids (token-id inputs taken as this model's own ids); "
        "not for a model with an upstream",
    )
    deterministic: bool | None = Field(
        default=None,
        description="Batch-invariant kernels (cpu backend): a request's logits are the same bits alone or batched "
        "with others'; costs throughput (docs/benchmarks.md). Unset: engine.deterministic; not for a model with an "
        "upstream",
    )
    passes: PassesSettings | None = Field(
        default=None,
        description="Load passes (cpu backend; docs/backends.md), as a configuration file's models[].passes: "
        "quantise (auto|blocks|native|hybrid|exact|int8|int4|bf16|f32), gemm_from (rows from which quantised projections use the "
        "GEMM path), pack (false: bfloat16 dense weights not packed once for oneDNN, saving the copies' memory), "
        "decode_loop (false: decode steps run the layers from Python instead of one C++ call); "
        "over engine.passes key by key. Not for a model with an upstream",
    )


@document("Served and loading models, with status", tag="models")
@requires(Scope.ADMIN_PLATFORM)
async def list_models(request: Request) -> Response:
    admin = state_of(request).model_admin
    return ok({"object": "list", "data": admin.describe_all()})


@document("Load a model in the background (progress at GET /admin/v1/models/{name})", tag="models",
          body=ModelLoadRequest, status=202)  # fmt: skip
@requires(Scope.ADMIN_PLATFORM)
async def load_model(request: Request) -> Response:
    principal = principal_of(request)
    body = await parse_body(request, ModelLoadRequest)
    admin = state_of(request).model_admin
    status = await admin.load(
        name=body.name, path=body.path, backend=body.backend, dtype=body.dtype, aliases=body.aliases,
        default=body.default, upstream=body.upstream,
        embedding=None if body.embedding is None else body.embedding.model_dump(),
        deterministic=body.deterministic,
        passes=None if body.passes is None else body.passes.model_dump(exclude_none=True),
    )
    where = {"upstream": status["upstream"]["endpoints"]} if "upstream" in status else {"path": body.path}
    if "passes_requested" in status:  # what the model loads with, engine.passes merged in: on the trail
        where["passes"] = status["passes_requested"]
    await record_change(request, principal, "model.load", None, "model", body.name, backend=status["backend"], **where)
    return ok(status, 202)


@document("A model's status and load progress", tag="models")
@requires(Scope.ADMIN_PLATFORM)
async def get_model(request: Request) -> Response:
    return ok(state_of(request).model_admin.describe(request.path_params["name"]))


@document("Unload a model and forget it", tag="models", status=204)
@requires(Scope.ADMIN_PLATFORM)
async def unload_model(request: Request) -> Response:
    principal = principal_of(request)
    name = request.path_params["name"]
    await state_of(request).model_admin.unload(name)
    await record_change(request, principal, "model.unload", None, "model", name)
    return Response(status_code=204)


@document("Make a model the default", tag="models", body=NoBody, body_required=False)
@requires(Scope.ADMIN_PLATFORM)
async def set_default_model(request: Request) -> Response:
    principal = principal_of(request)
    await parse_optional_body(request, NoBody)
    name = request.path_params["name"]
    status = await state_of(request).model_admin.set_default(name)
    await record_change(request, principal, "model.default", None, "model", name)
    return ok(status)


def routes() -> list[BaseRoute]:
    m = PREFIX + "/models"
    return [
        Route(m, list_models, methods=["GET"]),
        Route(m, load_model, methods=["POST"]),
        Route(m + "/{name}", get_model, methods=["GET"]),
        Route(m + "/{name}", unload_model, methods=["DELETE"]),
        Route(m + "/{name}/default", set_default_model, methods=["POST"]),
    ]
