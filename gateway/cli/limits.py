"""``inferctl admin limits``: a tenant's traffic policies, rate limits and quotas (``/admin/v1/.../policies``).

``get`` shows a tenant's policies (a tenant admin may read its own); ``set``
creates the policy of that name, or replaces its spec if the tenant has one
(platform admins: limits are what the platform grants). The spec is
``--spec`` JSON (inline or ``@file``, see docs/security.md), or built from
``--requests-per-minute``, ``--tokens-per-minute`` and
``--concurrent-requests`` for a rate limit, ``--period`` and ``--tokens`` for
a quota. ``--global`` instead of a tenant: the defaults every tenant inherits.
"""

from __future__ import annotations

import argparse
from typing import Any

from inferflux.gateway.cli.client import add_client_options, admin_call, deleted, json_object, list_all, show
from inferflux.gateway.cli.common import ClientError, positive_int

_COLUMNS = ("id", "kind", "name", "enabled", "spec")
_RATE_FLAGS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests")


def _base(args: argparse.Namespace) -> str:
    if args.global_ == (args.tenant is not None):
        raise ClientError("name a TENANT or give --global (the defaults every tenant inherits), not both")
    return "/policies" if args.global_ else f"/tenants/{args.tenant}/policies"


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    rate = {name: getattr(args, name) for name in _RATE_FLAGS if getattr(args, name) is not None}
    quota = {name: getattr(args, name) for name in ("period", "tokens") if getattr(args, name) is not None}
    given = [part for part in (args.spec is not None, bool(rate), bool(quota)) if part]
    if len(given) != 1:
        raise ClientError("give the limits as --spec JSON, or as rate-limit flags, or as --period and --tokens")
    if args.spec is not None:
        return json_object(args.spec, "--spec")
    if rate:
        if args.kind != "rate_limit":
            raise ClientError("--requests-per-minute, --tokens-per-minute and --concurrent-requests are rate limits")
        return rate
    if args.kind != "quota":
        raise ClientError("--period and --tokens make a quota: add --kind quota")
    return quota


def _limits(args: argparse.Namespace) -> int:
    base = _base(args)
    if args.action == "get":
        return show(args, list_all(args, base), _COLUMNS)
    if args.action == "delete":
        admin_call(args, "DELETE", f"{base}/{args.policy}")
        return deleted(args, "policy", args.policy)
    spec = _spec(args)
    existing = [p for p in list_all(args, base) if p["name"] == args.name]
    if len(existing) > 1:
        raise ClientError(f"{len(existing)} policies are named {args.name!r}: change one by hand (admin API)")
    if existing:
        if existing[0]["kind"] != args.kind:
            raise ClientError(f"policy {args.name!r} is a {existing[0]['kind']}, not a {args.kind}")
        body: dict[str, Any] = {"spec": spec, "enabled": not args.disable}
        return show(args, admin_call(args, "PATCH", f"{base}/{existing[0]['id']}", body), _COLUMNS)
    body = {"kind": args.kind, "name": args.name, "spec": spec, "enabled": not args.disable}
    return show(args, admin_call(args, "POST", base, body), _COLUMNS)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``limits get|set|delete`` to ``subparsers``."""
    parser = subparsers.add_parser(
        "limits",
        help="get or set a tenant's rate limits and quotas on a running server (set: platform admin)",
        description=(__doc__ or "").split("\n\n", 1)[1].replace("``", "'"),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    get = actions.add_parser("get", help="show a tenant's traffic policies")
    put = actions.add_parser("set", help="create or replace the policy named --name")
    delete = actions.add_parser("delete", help="delete one policy")
    for sub in (get, put, delete):  # the tenant first, so that 'get T' and 'delete T pol_...' read alike
        sub.add_argument("tenant", nargs="?", help="tenant id (or --global)")
        sub.add_argument("--global", dest="global_", action="store_true", help="the global defaults, not a tenant's")
    delete.add_argument("policy", help="policy id (pol_...)")
    put.add_argument("--name", required=True, help="the policy's name (set replaces the one of this name)")
    put.add_argument("--kind", choices=("rate_limit", "quota"), default="rate_limit", help="(default: %(default)s)")
    put.add_argument("--spec", metavar="JSON", help="the whole spec: JSON, inline or @file")
    put.add_argument("--requests-per-minute", type=positive_int, metavar="N")
    put.add_argument("--tokens-per-minute", type=positive_int, metavar="N")
    put.add_argument("--concurrent-requests", type=positive_int, metavar="N")
    put.add_argument("--period", choices=("day", "month"), help="a quota's period (UTC calendar)")
    put.add_argument("--tokens", type=positive_int, metavar="N", help="a quota's tokens per period")
    put.add_argument("--disable", action="store_true", help="store it disabled")
    for sub in (get, put, delete):
        add_client_options(sub)
        sub.add_argument("--json", action="store_true", help="print the raw response")
    parser.set_defaults(handler=_limits)
    return parser
