"""What the client commands share: the connection to a running server, its errors, tables of records.

The client commands (``generate``: the OpenAI API; ``admin_api`` and
``idps``: the admin API) talk HTTP only, so they work against any replica
and need none of the server's packages.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
from httpx_sse import EventSource, SSEError

from inferflux.gateway.cli.common import EXIT_OK, ClientError

DEFAULT_URL = "http://127.0.0.1:8080"


def add_client_options(parser: argparse.ArgumentParser) -> None:
    """``--url`` and ``--api-key``, defaulting to ``$INFERFLUX_URL`` and ``$INFERFLUX_API_KEY``."""
    parser.add_argument(
        "--url",
        default=os.environ.get("INFERFLUX_URL", DEFAULT_URL),
        help="base URL of the server (default: $INFERFLUX_URL or %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("INFERFLUX_API_KEY"),
        help="sent as a bearer token (default: $INFERFLUX_API_KEY)",
    )


def connect(args: argparse.Namespace) -> httpx.Client:
    """A client for ``--url`` with ``--api-key`` as its bearer token; no read timeout (generations stream)."""
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=httpx.Timeout(10.0, read=None))


def raise_for_error(response: httpx.Response) -> None:
    """A ClientError naming the status and the server's message, for a 4xx or 5xx answer."""
    if response.status_code < 400:
        return
    try:
        response.read()
        message = response.json()["error"]["message"]
    except Exception:  # not an OpenAI-shaped error: show what came back
        message = response.text[:500]
    raise ClientError(f"HTTP {response.status_code}: {message}")


def admin_call(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One call of the admin API (``path`` under ``/admin/v1``): its JSON answer, None for an empty one."""
    with connect(args) as client:
        response = client.request(method, "/admin/v1" + path, json=body)
        raise_for_error(response)
        return response.json() if response.content else None


def list_all(args: argparse.Namespace, path: str) -> list[dict[str, Any]]:
    """Every item of an admin list, following ``next_cursor`` page by page (``path`` may carry a query)."""
    rows: list[dict[str, Any]] = []
    after: str | None = None
    joiner = "&" if "?" in path else "?"
    while True:
        page = admin_call(args, "GET", f"{path}{joiner}limit=200" + (f"&after={after}" if after else ""))
        rows += page["data"]
        after = page.get("next_cursor")
        if not after:
            return rows


def show(args: argparse.Namespace, value: Any, columns: Sequence[str]) -> int:
    """Print a record or a list of them: as JSON with ``--json``, else as a table of ``columns``."""
    if args.json:
        print(json.dumps(value, indent=2))
    else:
        _print_rows(value if isinstance(value, list) else [value], columns)
    return EXIT_OK


def _print_rows(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    """A plain table: easy to read, easy to cut/awk."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # a spec, printed as it is given (--spec JSON), never as a Python repr
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if isinstance(value, list):
        return ",".join(map(_cell, value)) or "(none)"
    return str(value)


def json_object(value: str, flag: str) -> dict[str, Any]:
    """A JSON object given inline or as ``@file`` (for ``flag``); ClientError naming the flag otherwise."""
    try:
        if value.startswith("@"):
            with open(value[1:], encoding="utf-8") as handle:
                value = handle.read()
        parsed = json.loads(value)
    except (OSError, ValueError) as exc:
        raise ClientError(f"{flag} takes a JSON object, inline or as @file: {exc}") from None
    if not isinstance(parsed, dict):
        raise ClientError(f"{flag} takes a JSON object, e.g. '{{\"key\": \"value\"}}'")
    return parsed


def deleted(args: argparse.Namespace, what: str, ident: str) -> int:
    """Report a deletion: one line, or ``{"id": ..., "deleted": true}`` with ``--json``."""
    if getattr(args, "json", False):
        print(json.dumps({"id": ident, "deleted": True}))
    else:
        print(f"deleted {what} {ident}")
    return EXIT_OK


def stream_payloads(events: EventSource) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a generation's stream, until ``[DONE]``; ClientError for an error in it."""
    try:
        for event in events.iter_sse():
            if event.data == "[DONE]":
                return
            payload = json.loads(event.data)
            if "error" in payload:
                raise ClientError(payload["error"].get("message", "error in stream"))
            yield payload
    except SSEError as exc:  # a 2xx answer that is not an event stream
        raise ClientError(str(exc)) from None
