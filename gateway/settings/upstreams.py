"""The ``upstream`` section of a model and the ``upstreams`` section: where models of the ``openai``
backend may be served from, with which key and which CA.

A model's upstream is checked here in two steps wherever it enters (the
settings file, the admin API, ``inferctl``, a model record loaded from the
store): its shape (``UpstreamSettings``: URLs without credentials, bounds), then
the least-privilege rules of ``UpstreamPolicySettings.check`` against this
gateway's ``upstreams`` section:

- ``api_key_env`` only under ``upstreams.api_key_env_prefix`` (default
  ``INFERFLUX_UPSTREAM_``), and never a variable the gateway reads a secret of
  its own from (the bootstrap admin key, the store's passphrase and URL, an
  audit sink's token): a model cannot be handed the server's own secrets;
- each endpoint through the egress rules (``backends.openai.egress``): without
  ``upstreams.allowed_hosts`` no link-local, metadata, private or loopback
  address and never the gateway's own port; the same rules judge every resolved
  address at connect time;
- ``ca_file`` only under ``upstreams.ca_dir`` (none set: no ``ca_file``), with one
  answer whether or not the file exists.
"""

from __future__ import annotations

import os
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferflux.backends.openai.egress import EgressPolicy, EgressRefused, own_addresses, parse_host_entry

DEFAULT_KEY_ENV_PREFIX = "INFERFLUX_UPSTREAM_"
# Where the gateway reads secrets of its own (gateway.cli, gateway.settings.loading): never an upstream's key.
GATEWAY_SECRET_VARIABLES = (
    "INFERFLUX_BOOTSTRAP_ADMIN_KEY", "INFERFLUX_STORE_PASSPHRASE", "INFERFLUX_STORE_NEW_PASSPHRASE",
    "INFERFLUX_STORE_URL", "INFERFLUX_STORE_KEY_FILE", "INFERFLUX_REDIS_URL", "INFERFLUX_API_KEY",
)  # fmt: skip


class UpstreamRefused(ValueError):
    """An upstream section breaks a rule of the ``upstreams`` section; ``field`` is the key it names."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_endpoint(url: str) -> str:
    """An upstream base URL: http(s), a host, no credentials, query or fragment; without its trailing slash."""
    parsed = urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"an upstream endpoint must be an http:// or https:// URL with a host, not {url!r}")
    if parsed.username is not None or parsed.password is not None:
        raise ValueError("an upstream endpoint must not carry credentials: store them as a credential")
    if parsed.query or parsed.fragment:
        raise ValueError("an upstream endpoint must not have a query or a fragment")
    try:
        parsed.port  # noqa: B018 - raises on a port out of range
    except ValueError:
        raise ValueError(f"an upstream endpoint has an invalid port: {url!r}") from None
    return url.rstrip("/")


class UpstreamSettings(BaseModel):
    """Where a model of the ``openai`` backend is served from (``backends.openai``)."""

    model_config = ConfigDict(extra="forbid")

    endpoints: list[str] = Field(min_length=1, max_length=64)  # base URLs, e.g. http://10.0.0.5:8000/v1
    model: str | None = Field(default=None, min_length=1, max_length=200)  # the upstream's own name; default: the model's
    credential: str | None = Field(default=None, min_length=1, max_length=200)  # a stored credential, by name
    # An environment variable holding the key: only under upstreams.api_key_env_prefix.
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
    timeout_seconds: float = Field(default=600.0, gt=0, le=3600)
    idle_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)  # the longest silence within a stream
    max_inflight_per_endpoint: int = Field(default=64, ge=1, le=10000)
    retries: int = Field(default=2, ge=0, le=5)  # only before the first byte, on another endpoint where there is one
    health_interval_seconds: float = Field(default=5.0, ge=0, le=3600)  # GET {endpoint}/models; 0: passive checks only
    routing: Literal["prefix", "least_outstanding"] = "prefix"
    context_length: int | None = Field(default=None, gt=0)  # what /v1/models says; unset: not advertised
    # A private CA for https endpoints: a PEM file under upstreams.ca_dir.
    ca_file: str | None = Field(default=None, min_length=1, max_length=4096)

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, value: list[str]) -> list[str]:
        urls = [check_endpoint(u) for u in value]
        if len(set(urls)) != len(urls):
            raise ValueError("an upstream endpoint is listed twice")
        return urls

    @model_validator(mode="after")
    def _one_key_source(self) -> UpstreamSettings:
        if self.credential is not None and self.api_key_env is not None:
            raise ValueError("give credential or api_key_env, not both")
        return self


class UpstreamPolicySettings(BaseModel):
    """What the gateway may connect to, present and trust for the ``openai`` backend's models."""

    model_config = ConfigDict(extra="forbid")

    # Host names, "*.example.com", IPs and CIDR ranges an upstream endpoint may name or resolve to.
    # Unset: public addresses only (no private, loopback, link-local or metadata address).
    # Set it wherever the admin API is exposed, so that it cannot make the gateway a request forwarder.
    allowed_hosts: list[str] | None = Field(default=None, max_length=1024)
    # api_key_env may only name variables starting with this (never one the gateway's own secrets are in).
    api_key_env_prefix: str = Field(default=DEFAULT_KEY_ENV_PREFIX, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    # ca_file may only name a file under this directory (symbolic links resolved); unset: no ca_file.
    ca_dir: str | None = Field(default=None, min_length=1, max_length=4096)
    # Client headers passed upstream; nothing else of the client's travels (its credentials never do).
    forward_headers: list[str] = Field(default_factory=lambda: ["traceparent", "tracestate"], max_length=32)

    @field_validator("forward_headers")
    @classmethod
    def _no_credentials(cls, value: list[str]) -> list[str]:
        names = [v.strip().lower() for v in value]
        banned = {"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization", "host"} & set(names)
        if banned:
            raise ValueError(f"these headers must never be forwarded upstream: {', '.join(sorted(banned))}")
        return names

    @field_validator("allowed_hosts")
    @classmethod
    def _host_entries(cls, value: list[str] | None) -> list[str] | None:
        for entry in value or ():
            parse_host_entry(entry)  # ValueError naming the entry
        return value

    @field_validator("api_key_env_prefix")
    @classmethod
    def _not_the_gateways_secrets(cls, value: str) -> str:
        covered = [name for name in GATEWAY_SECRET_VARIABLES if name.startswith(value)]
        if covered:
            raise ValueError(f"the prefix {value!r} would let a model's key be the gateway's own {covered[0]}")
        return value

    @field_validator("ca_dir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not os.path.isabs(os.path.expanduser(value)):
            raise ValueError("ca_dir must be an absolute path")
        return os.path.realpath(os.path.expanduser(value))

    def egress(self, host: str, port: int) -> EgressPolicy:
        """The egress rules of a gateway listening on ``host``:``port`` (``backends.openai.egress``)."""
        allowed = None if self.allowed_hosts is None else tuple(self.allowed_hosts)
        return EgressPolicy(allowed_hosts=allowed, own_port=port, own_addresses=own_addresses(host))

    def check(self, upstream: UpstreamSettings, egress: EgressPolicy, reserved: frozenset[str] = frozenset()) -> None:
        """Raises UpstreamRefused naming the first key of ``upstream`` that breaks a rule (module docstring).

        ``reserved``: more variables no key may come from (the audit sinks' ``token_env``).
        """
        if upstream.api_key_env is not None:
            self._check_variable(upstream.api_key_env, reserved)
        for position, url in enumerate(upstream.endpoints):
            try:
                egress.check_endpoint(url)
            except EgressRefused as exc:
                raise UpstreamRefused("endpoints", f"[{position}] {exc}") from None
        if upstream.ca_file is not None:
            self._check_ca_file(upstream.ca_file)

    def _check_variable(self, variable: str, reserved: frozenset[str]) -> None:
        """Raises UpstreamRefused unless ``variable`` may hold an upstream's key (``check``'s first rule)."""
        if not variable.startswith(self.api_key_env_prefix):
            raise UpstreamRefused("api_key_env", f"must start with {self.api_key_env_prefix!r} "
                                  "(upstreams.api_key_env_prefix)")  # fmt: skip
        if variable in GATEWAY_SECRET_VARIABLES or variable in reserved:
            raise UpstreamRefused("api_key_env", "names a variable that holds a secret of the gateway's own")

    def _check_ca_file(self, ca_file: str) -> None:
        # One answer for every path refused, so that it tells nothing of what exists outside ca_dir.
        refused = UpstreamRefused("ca_file", "must be an absolute path to a file under upstreams.ca_dir"
                                  + ("" if self.ca_dir else ", which is not set"))  # fmt: skip
        if self.ca_dir is None or not os.path.isabs(ca_file) or "\x00" in ca_file:
            raise refused
        try:
            real = os.path.realpath(ca_file)  # symbolic links out of the directory are out of it
        except (OSError, ValueError):
            raise refused from None
        if os.path.commonpath([real, self.ca_dir]) != self.ca_dir or real == self.ca_dir:
            raise refused
