"""``FleetConfig``: where one model's upstream fleet is and how patient to be with it.

Checked once, when a model is loaded (from the settings or ``POST
/admin/v1/models``): a URL that could carry a credential, a query or another
scheme, or a value the client cannot honour, is refused here with a message
that never repeats the URL (it may hold a password). So is an endpoint the
egress rules refuse (``egress.py``: link-local and metadata addresses, private
ones not allowed, the gateway's own port); the default ``EgressPolicy`` has no
allow list, so a private or loopback endpoint needs one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from inferflux.backends.openai.egress import EgressPolicy, EgressRefused

__all__ = ["FleetConfig"]

BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # control characters a header or URL must not hold


def _endpoint_url(position: int, url: str) -> str:
    """``url`` checked and without its trailing slash; ValueError (not naming the URL: it may hold a password)."""
    where = f"endpoints[{position}]"
    if not isinstance(url, str) or not url or url != url.strip() or BAD_VALUE.search(url) or " " in url:
        raise ValueError(f"{where}: not a URL")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        raise ValueError(f"{where}: not a URL") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{where}: the scheme must be http or https")
    if "@" in parts.netloc:
        raise ValueError(f"{where}: credentials in the URL are not allowed (use the api key)")
    if not parts.hostname:
        raise ValueError(f"{where}: the URL has no host")
    if "?" in url or "#" in url:
        raise ValueError(f"{where}: a base URL takes no query or fragment")
    return url.rstrip("/")


@dataclass(frozen=True)
class FleetConfig:
    """How to reach one model's upstream fleet and how patient to be with it.

    ``api_key`` is sent as ``Authorization: Bearer``; it is left out of the
    repr and of every error and status. ``timeout_seconds`` bounds a whole
    request, stream included; the longest silence tolerated before the answer
    or between two stream chunks is ``min(timeout_seconds,
    idle_timeout_seconds)`` (a generation asked for unstreamed is silent until
    it is done, so only ``timeout_seconds`` bounds its wait).
    ``connect_timeout_seconds`` bounds opening a connection, or waiting for
    a free one in a full pool. ``retries`` extra attempts are made, only before
    the first byte of the body. ``health_interval_seconds`` 0 turns the
    active check off (the breaker still learns from requests). ``ca_file``
    is for https endpoints behind a private CA, since the client reads no
    proxy or credential from the environment (see ``Fleet``). ``egress`` says
    which hosts and addresses the endpoints may be, checked here and at every
    connection (``egress.py``).
    """

    endpoints: tuple[str, ...]
    api_key: str | None = field(default=None, repr=False)
    timeout_seconds: float = 600.0
    idle_timeout_seconds: float = 60.0
    connect_timeout_seconds: float = 5.0
    max_inflight_per_endpoint: int = 64
    retries: int = 2
    health_interval_seconds: float = 5.0
    breaker_failures: int = 5
    breaker_reset_seconds: float = 10.0
    routing: Literal["least_outstanding", "prefix"] = "prefix"
    ca_file: str | None = None  # a PEM bundle that https endpoints' certificates must chain to (default: the system's)
    egress: EgressPolicy = field(default_factory=EgressPolicy)

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            raise ValueError("endpoints: a list of base URLs, not one string")
        endpoints = tuple(_endpoint_url(i, url) for i, url in enumerate(self.endpoints))
        if not endpoints:
            raise ValueError("endpoints: at least one is needed")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError("endpoints: the same URL is listed twice")
        for position, url in enumerate(endpoints):
            try:
                self.egress.check_endpoint(url)
            except EgressRefused as exc:
                raise ValueError(f"endpoints[{position}]: {exc}") from None
        object.__setattr__(self, "endpoints", endpoints)
        if self.api_key is not None and (not self.api_key or BAD_VALUE.search(self.api_key) or
                                         self.api_key != self.api_key.strip()):  # fmt: skip
            raise ValueError("api_key: empty, or holds whitespace or control characters at its ends")
        for name in ("timeout_seconds", "idle_timeout_seconds", "connect_timeout_seconds", "breaker_reset_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be above 0")
        if not self.health_interval_seconds >= 0:
            raise ValueError("health_interval_seconds: must be 0 (off) or above")
        for name in ("max_inflight_per_endpoint", "breaker_failures"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name}: must be a whole number, 1 or more")
        if not (isinstance(self.retries, int) and self.retries >= 0):
            raise ValueError("retries: must be a whole number, 0 or more")
        if self.routing not in ("least_outstanding", "prefix"):
            raise ValueError("routing: must be least_outstanding or prefix")

    @property
    def idle_seconds(self) -> float:
        """The longest silence tolerated from an upstream, before its answer or between two chunks."""
        return min(self.timeout_seconds, self.idle_timeout_seconds)
