"""The ``openai`` backend's models as the gateway configures them: checked upstream sections and their keys.

An upstream section is checked twice over: its shape by
``gateway.settings.UpstreamSettings`` (URLs without credentials, bounds), and
its hosts against ``upstreams.allowed_hosts``, so that neither the YAML nor
the admin API can point the gateway at a host the operator did not allow.
Its key comes from a stored, encrypted credential named in it (rotated through
the admin API) or from an environment variable; neither is ever logged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from inferflux.backends.base import BackendError
from inferflux.gateway.settings import Settings
from inferflux.gateway.settings.sections import UpstreamSettings
from inferflux.gateway.validation_errors import first_error
from inferflux.policy.errors import NotFound, ValidationFailed
from inferflux.policy.store import PolicyStore


def checked_upstream(settings: Settings, raw: Any) -> dict[str, Any]:
    """``raw`` (an admin API body's ``upstream``) as plain data, or ValidationFailed (422) naming the field."""
    try:
        upstream = UpstreamSettings.model_validate(raw)
    except ValidationError as exc:
        first = first_error(exc)
        raise ValidationFailed(first.line(), param=f"upstream.{first.path}" if first.path else "upstream") from None
    try:
        settings.upstreams.check_hosts(upstream.endpoints)
    except ValueError as exc:
        raise ValidationFailed(str(exc), param="upstream.endpoints") from None
    return upstream.model_dump()


def upstream_key(store: PolicyStore, upstream: Mapping[str, Any] | None) -> str | None:
    """The key a model's upstream is called with: its stored credential's secret, or its variable's value.

    Raises ``BackendError`` (the model does not load) when either is named but missing.
    """
    if not upstream:
        return None
    credential, variable = upstream.get("credential"), upstream.get("api_key_env")
    if credential:
        try:
            return store.credential_secret_by_name(credential)
        except NotFound:
            raise BackendError(f"no stored credential is named {credential!r}") from None
    if variable:
        value = os.environ.get(variable)
        if not value:
            raise BackendError(f"the environment variable {variable} (upstream.api_key_env) is not set")
        return value
    return None


def describe_upstream(upstream: Mapping[str, Any]) -> dict[str, Any]:
    """An upstream section as the admin API shows it: where from and how, never a key."""
    shown = ("endpoints", "model", "credential", "api_key_env", "timeout_seconds", "max_inflight_per_endpoint", "routing")
    return {k: upstream.get(k) for k in shown if upstream.get(k) is not None}
