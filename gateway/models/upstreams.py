"""The ``openai`` backend's models as the gateway configures them: checked upstream sections and their keys.

An upstream section is checked wherever it enters (the admin API, ``inferctl``
through it, the settings file, a model record loaded from the store): its shape
by ``gateway.settings.UpstreamSettings``, then the least-privilege rules of the
``upstreams`` section (``gateway.settings.upstreams``: the key's variable, the
hosts, the CA file), so that neither the YAML nor the admin API can point the
gateway at a host the operator did not allow or hand a model a secret of the
gateway's own. Its key comes from a stored, encrypted credential named in it
(rotated through the admin API) or from an environment variable; neither is
ever logged, and a key that is named but missing is a 422 when the model is
defined, not a failure later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from inferflux.backends.base import BackendError
from inferflux.backends.openai.egress import EgressPolicy
from inferflux.gateway.settings import Settings
from inferflux.gateway.settings.upstreams import UpstreamRefused, UpstreamSettings
from inferflux.gateway.validation_errors import first_error
from inferflux.policy.errors import NotFound, ValidationFailed
from inferflux.policy.store import PolicyStore


def egress_policy(settings: Settings) -> EgressPolicy:
    """The egress rules every upstream connection of this gateway is held to."""
    return settings.upstreams.egress(settings.host, settings.port)


def checked_upstream(settings: Settings, raw: Any, egress: EgressPolicy | None = None) -> dict[str, Any]:
    """``raw`` (an admin API body's ``upstream``, or a stored model's) as plain data, or ValidationFailed
    (422) naming the field and the rule it breaks."""
    try:
        upstream = UpstreamSettings.model_validate(raw)
    except ValidationError as exc:
        first = first_error(exc)
        raise ValidationFailed(first.line(), param=f"upstream.{first.path}" if first.path else "upstream") from None
    try:
        settings.upstreams.check(upstream, egress or egress_policy(settings), settings.secret_variables())
    except UpstreamRefused as exc:
        raise ValidationFailed(f"upstream.{exc}", param=f"upstream.{exc.field}") from None
    return upstream.model_dump()


def check_key_source(store: PolicyStore, upstream: Mapping[str, Any]) -> None:
    """ValidationFailed (422) when the credential or variable ``upstream`` names for its key does not exist
    (on the thread pool: it reads the store)."""
    credential, variable = upstream.get("credential"), upstream.get("api_key_env")
    if credential:
        try:
            store.credential_secret_by_name(credential)
        except NotFound:
            raise ValidationFailed(f"upstream.credential: no stored credential is named {credential!r} "
                                   "(create it first: POST /admin/v1/credentials)",
                                   param="upstream.credential") from None  # fmt: skip
    if variable and not os.environ.get(variable):
        raise ValidationFailed(f"upstream.api_key_env: the environment variable {variable} is not set on this server",
                               param="upstream.api_key_env")  # fmt: skip


def upstream_key(store: PolicyStore, upstream: Mapping[str, Any] | None, settings: Settings,
                 egress: EgressPolicy | None = None) -> str | None:  # fmt: skip
    """The key a model's upstream is called with: its stored credential's secret, or its variable's value.

    Every model is loaded through here, so the section is checked against
    ``settings`` here too, whatever path it came by (a record stored before a
    rule existed, the settings file). Raises ``BackendError`` (the model does
    not load) naming the rule it breaks, or when a key is named but missing.
    """
    if not upstream:
        return None
    try:
        checked_upstream(settings, upstream, egress)
    except ValidationFailed as exc:
        raise BackendError(exc.message) from None
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
