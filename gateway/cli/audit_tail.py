"""``inferctl audit tail``: the latest audit events of a running server (``GET /admin/v1/audit``), and ``--follow``.

A tenant admin sees its own tenant's events; a platform admin every
tenant's, or those of ``--tenant``. The query API returns events oldest first: tail
reads the pages since ``--since`` (default: the last hour) and prints the
last ``--lines``. With ``--follow`` it then asks again every ``--interval``
seconds for events at or after the newest it printed, and prints those it
has not (an event just recorded takes a moment to be indexed). ``--json``:
one JSON object a line (the event with its place in the hash chain).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from inferflux.gateway.cli.client import add_client_options, admin_call
from inferflux.gateway.cli.common import EXIT_OK, positive_int, subparsers_of

_MAX_PAGES = 1000  # a bound on one poll: 200,000 events


def _query(args: argparse.Namespace, since: str) -> list[dict[str, Any]]:
    """Every event since ``since`` matching the filters, oldest first."""
    params = {"since": since, "limit": "200"}
    for name in ("principal", "decision", "kind"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    if args.tenant is not None:
        params["tenant_id"] = args.tenant
    events: list[dict[str, Any]] = []
    for _ in range(_MAX_PAGES):
        page = admin_call(args, "GET", "/audit?" + urlencode(params))
        events += page["data"]
        if not page.get("next_cursor"):
            break
        params["after"] = page["next_cursor"]
    return events


def _print(args: argparse.Namespace, event: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(event, separators=(",", ":")), flush=True)
        return
    who = event.get("principal") or "-"
    what = event.get("action") or event.get("route") or event.get("kind")
    status = event.get("status")
    print(f"{event.get('at')}  {event.get('decision', '-'):5}  {event.get('tenant_id') or '-'}  {who}  {what}"
          + (f"  {status}" if status is not None else "") + "".join(f"  {r}" for r in event.get("reasons") or ()),
          flush=True)  # fmt: skip


def _tail(args: argparse.Namespace) -> int:
    since = args.since or (datetime.now(UTC) - timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    events = _query(args, since)
    seen = {e["hash"] for e in events}
    for event in events[-args.lines :]:
        _print(args, event)
    while args.follow:
        time.sleep(args.interval)
        newest = events[-1]["at"] if events else since
        fresh = [e for e in _query(args, newest) if e["hash"] not in seen]
        for event in fresh:
            seen.add(event["hash"])
            _print(args, event)
        events += fresh
    return EXIT_OK


def _seconds(value: str) -> float:
    """An argparse type: a poll interval, 0.1 to 3600 seconds."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0.1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"not a number of seconds from 0.1 to 3600: {value!r}")
    return seconds


def add_parser(audit: argparse.ArgumentParser) -> None:
    """Add ``tail`` to the ``audit`` command (beside ``verify``, which reads a spool)."""
    tail = subparsers_of(audit).add_parser(
        "tail",
        help="print a running server's latest audit events; --follow for new ones",
        description=(__doc__ or "").split("\n\n", 1)[1].replace("``", "'"),
    )
    tail.add_argument("-n", "--lines", type=positive_int, default=20, help="events to print (default: %(default)s)")
    tail.add_argument("-f", "--follow", action="store_true", help="keep polling for new events (Ctrl-C stops)")
    tail.add_argument("--interval", type=_seconds, default=2.0, help="seconds between polls, 0.1 to 3600 "
                      "(default: %(default)s)")  # fmt: skip
    tail.add_argument("--since", metavar="TIME", help="RFC 3339 with a time zone (default: an hour ago)")
    tail.add_argument("--tenant", metavar="ID", help="platform admins: this tenant's events only")
    tail.add_argument("--principal", help="who made the call: key:<prefix>, oidc:...")
    tail.add_argument("--decision", choices=("allow", "deny", "error"))
    tail.add_argument("--kind", choices=("api", "admin", "checkpoint"))
    add_client_options(tail)
    tail.add_argument("--json", action="store_true", help="one JSON event a line")
    tail.set_defaults(handler=_tail)
