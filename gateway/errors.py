"""The gateway's error hierarchy and its OpenAI-shaped rendering.

Every error a client can see is an ``ApiError`` (``policy.errors``): a
``GatewayError`` from here or a ``PolicyError`` from the policy layer. Each
carries its HTTP status, the OpenAI ``type`` and ``code`` and the offending
``param``, so handlers raise and one exception handler renders. Anything else that escapes a handler is a
bug and is rendered as an opaque 500 (the traceback goes to the log, never to
the client).

Authentication and authorisation errors (401, 403) live in ``policy.errors``;
later layers (rate limits, guardrails) add their own subclasses. The statuses
and ``type`` strings are the public contract.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from inferflux.policy.errors import ApiError


def error_payload(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class GatewayError(ApiError):
    """Base of every error the gateway itself raises towards a client."""

    def to_response(self, request_id: str | None = None) -> JSONResponse:
        return render_error(self, request_id)


def error_body(exc: ApiError) -> dict[str, Any]:
    return error_payload(exc.message, exc.error_type, param=exc.param, code=exc.code)


def render_error(exc: ApiError, request_id: str | None = None) -> JSONResponse:
    """Any client-facing error (the gateway's or the policy layer's) as OpenAI-shaped JSON."""
    headers = dict(exc.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(error_body(exc), status_code=exc.status_code, headers=headers)


# -- 4xx: the client's fault -------------------------------------------------


class InvalidRequest(GatewayError):
    """400: the request is well-formed HTTP but its content is not acceptable."""

    status_code = 400
    error_type = "invalid_request_error"


class MalformedJSON(InvalidRequest):
    default_code = "invalid_json"


class UnsupportedParameter(InvalidRequest):
    """A known OpenAI parameter this server does not implement.

    Rejected rather than ignored, because silently ignoring e.g. ``logit_bias``
    or ``tools`` would return something other than what the client asked for.
    """

    default_code = "unsupported_parameter"


class ContextLengthExceeded(InvalidRequest):
    default_code = "context_length_exceeded"


class SchemaTooComplex(InvalidRequest):
    """A schema, tool list or guided regex over a size limit (``gateway.pipeline.body``), or a grammar over
    its budget (``backends.engine.grammar_sandbox``); ``param`` names the field."""

    default_code = "schema_too_complex"


class NotFound(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist", param="model")
        self.model = model


class MethodNotAllowed(GatewayError):
    status_code = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class RequestTooLarge(GatewayError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class UnsupportedMediaType(GatewayError):
    status_code = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class RateLimited(GatewayError):
    """429; ``retry_after`` seconds becomes the Retry-After header."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float | None = None, code: str | None = None) -> None:
        headers = {"retry-after": str(max(1, round(retry_after)))} if retry_after is not None else None
        super().__init__(message, code=code, headers=headers)


# -- 5xx: ours ---------------------------------------------------------------


class InternalError(GatewayError):
    status_code = 500
    default_code = "internal_error"


class ServiceUnavailable(GatewayError):
    """503: retryable; the client did nothing wrong."""

    status_code = 503
    error_type = "server_error"
    default_code = "service_unavailable"


class EngineOverloaded(ServiceUnavailable):
    default_code = "engine_overloaded"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        headers = {"retry-after": str(max(1, round(retry_after)))} if retry_after is not None else None
        super().__init__(message, headers=headers)


class GrammarBusy(EngineOverloaded):
    """503: every grammar worker stayed busy for ``grammar.queue_seconds``; retry."""

    default_code = "grammar_busy"


class UpstreamUnavailable(EngineOverloaded):
    """503 for a remote model: no upstream endpoint can take the request now (down, circuit open, full)."""

    default_code = "upstream_unavailable"


class ModelNotReady(ServiceUnavailable):
    default_code = "model_not_ready"
