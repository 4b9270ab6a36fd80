"""The OpenAPI 3.1 document, built from the routes themselves.

Endpoints carry their documentation (``@document``) and their scope
(``gateway.authz.requires``) as attributes, and request bodies are the same
pydantic models the handlers validate with, so the document cannot drift from
what the server does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

F = TypeVar("F", bound=Callable[..., Any])

DOC_ATTR = "openapi_doc"
_CONVERTOR = re.compile(r"{(\w+):\w+}")
_REF = "#/components/schemas/{model}"


def document(
    summary: str,
    *,
    tag: str,
    body: type[BaseModel] | None = None,
    body_required: bool = True,
    status: int = 200,
    paginated: bool = False,
    streams: bool = False,
    query: Iterable[dict[str, Any]] = (),
) -> Callable[[F], F]:
    """Mark an endpoint with its documentation; ``query``: its query parameters (``query_param``).

    Every POST, PUT and PATCH names its ``body`` (an action without fields takes ``NoBody``, optional),
    so that clients and fuzzers know what it reads (a test checks).
    """

    def mark(endpoint: F) -> F:
        doc = {"summary": summary, "tag": tag, "body": body, "body_required": body_required, "status": status,
               "paginated": paginated, "streams": streams, "query": tuple(query)}  # fmt: skip
        setattr(endpoint, DOC_ATTR, doc)
        return endpoint

    return mark


def query_param(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """One optional query parameter, as an OpenAPI parameter object."""
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or invalid credentials",
    "403": "The credential lacks the required scope",
    "404": "Not found (also for another tenant's objects)",
    "413": "Request body too large",
    "422": "Invalid values",
    "429": "Rate limited",
    "503": "Temporarily unavailable",
}


def _operation(route: Route, method: str, schemas: dict[str, Any]) -> dict[str, Any]:
    from inferflux.gateway.authz import SCOPE_ATTR

    endpoint = route.endpoint
    doc: dict[str, Any] = getattr(endpoint, DOC_ATTR, None) or {"summary": route.name, "tag": "other", "status": 200}
    scope = getattr(endpoint, SCOPE_ATTR, None)
    op: dict[str, Any] = {
        "operationId": f"{method.lower()}_{route.name}",
        "summary": doc["summary"],
        "tags": [doc["tag"]],
    }
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in route.param_convertors
    ]
    if doc.get("paginated"):
        params += [
            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 200, "default": 50}},
            {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "next_cursor of the previous page"},
        ]
    params += doc.get("query", ())
    if params:
        op["parameters"] = params
    body = doc.get("body")
    if body is not None:
        schema = body.model_json_schema(ref_template=_REF)
        for name, sub in schema.pop("$defs", {}).items():
            schemas[name] = sub
        schemas[body.__name__] = schema
        op["requestBody"] = {
            "required": doc.get("body_required", True),
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=body.__name__)}}},
        }
    success: dict[str, Any] = {"description": "Success"}
    if doc["status"] != 204:
        content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
        if doc.get("streams"):
            content["text/event-stream"] = {"schema": {"type": "string"}}
        success["content"] = content
    op["responses"] = {
        str(doc["status"]): success,
        **{
            code: {"description": text, "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}
            for code, text in _ERROR_STATUSES.items()
        },
    }
    if scope is not None:
        op["security"] = [{"bearer": []}, {"apiKey": []}]
        op["x-required-scope"] = scope.value
    else:
        op["security"] = []
    return op


def openapi_path(path: str) -> str:
    """A route's path as OpenAPI writes it: ``/v1/models/{model_id:path}`` -> ``/v1/models/{model_id}``."""
    return _CONVERTOR.sub(r"{\1}", path)


def build_openapi(routes: Iterable[BaseRoute], *, title: str, version: str) -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": _ERROR_SCHEMA}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route) or not route.methods:
            continue
        path = openapi_path(route.path)
        for method in sorted(route.methods - {"HEAD"}):
            paths.setdefault(path, {})[method.lower()] = _operation(route, method, schemas)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": "OpenAI-compatible tenant API (/v1) and admin API (/admin/v1).",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "An API key (ifx_...) or an OIDC JWT"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }


def openapi_route(title: str, version: str) -> Callable[[Request], Any]:
    cache: dict[str, Any] = {}

    async def openapi(request: Request) -> Response:
        if "doc" not in cache:
            cache["doc"] = build_openapi(request.app.routes, title=title, version=version)
        return JSONResponse(cache["doc"])

    return openapi
