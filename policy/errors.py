"""The policy layer's error hierarchy.

Each error carries the HTTP status, OpenAI-style ``type`` and machine-readable
``code`` it should be answered with, so the gateway renders any of them with one
handler and no mapping table. ``policy/`` never imports ``gateway/``; the
gateway imports this module.

Cross-tenant access is always answered with ``NotFound`` (never
``PermissionDenied``) so that a caller cannot learn that another tenant's
object exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar


class ApiError(Exception):
    """An error a client sees: its HTTP status, OpenAI-style ``type``, ``code``, ``param``.

    The root of both hierarchies, this one and ``gateway.errors``, so the
    gateway renders every client-facing error with one function.
    """

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param
        self.headers = dict(headers or {})


class PolicyError(ApiError):
    """Base of every error the policy layer raises towards a client."""


class AuthenticationError(PolicyError):
    """401: no credentials, or credentials that do not prove an identity."""

    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_credentials"

    def __init__(self, message: str, *, code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message, code=code, headers={"www-authenticate": "Bearer", **(headers or {})})


class InvalidApiKey(AuthenticationError):
    default_code = "invalid_api_key"


class InvalidToken(AuthenticationError):
    """A bearer JWT that failed validation; ``code`` names the rule it broke."""

    default_code = "invalid_token"


class PermissionDenied(PolicyError):
    """403: the caller is known but its role lacks the scope (within its own tenant)."""

    status_code = 403
    error_type = "permission_error"
    default_code = "insufficient_scope"


class NotFound(PolicyError):
    """404: does not exist, or belongs to another tenant (deliberately indistinguishable)."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class Conflict(PolicyError):
    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class ValidationFailed(PolicyError):
    """422: a well-formed request whose values are not acceptable."""

    status_code = 422
    error_type = "invalid_request_error"
    default_code = "invalid_value"


class StoreUnavailable(PolicyError):
    """503: the policy store cannot be reached; retryable, never a 500."""

    status_code = 503
    error_type = "server_error"
    default_code = "policy_store_unavailable"

    def __init__(self, message: str, *, code: str | None = None, retry_after: int = 1) -> None:
        # Retryable: the store is usually back within seconds (a failover, a restart).
        super().__init__(message, code=code, headers={"retry-after": str(retry_after)})


class PolicyUnusable(PolicyError):
    """503: a stored policy cannot be used (written by an older version, or edited in the database),
    so the requests it governs are refused (fail closed); the message names the policy and its id."""

    status_code = 503
    error_type = "server_error"
    default_code = "policy_unusable"


class StoreConfigError(Exception):
    """The store cannot be opened as configured (wrong or missing key, bad URL).

    Raised at start-up, not rendered to clients: the server refuses to start.
    """


class IdentityProviderUnavailable(PolicyError):
    """503: an OIDC identity provider's discovery document or keys cannot be fetched; retryable."""

    status_code = 503
    error_type = "server_error"
    default_code = "identity_provider_unavailable"
