"""The HTTP gateway: the OpenAI-compatible API, the admin API and console, and the request path between them."""

from __future__ import annotations

import importlib.metadata


def _version() -> str:
    try:
        return importlib.metadata.version("inferflux")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


# The installed distribution's version: the OpenAPI document, the status page, traces and fingerprints name it.
VERSION = _version()
