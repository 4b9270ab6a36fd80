"""``inferctl admin usage|prices|budgets``: usage and spend, the price table, and budgets on a running server.

``usage`` reads ``GET /admin/v1/usage`` (a table, ``--json`` or ``--csv``;
filters ``--tenant``, ``--key``, ``--model``, ``--from``, ``--to``; ``--group
day|hour|minute``; ``--by tenant,key,model``); ``--all`` follows the pages. A
tenant admin sees its own tenant. ``prices`` lists, sets and deletes a model's
price in dollars per million prompt and completion tokens (platform admins).
``budgets`` shows, sets and deletes a tenant's monthly budgets, which are
traffic policies of kind ``budget``: ``set TENANT --spend-usd 250 --tokens N``
for the tenant, with ``--key KEY_ID`` for one key, ``--per-key-spend-usd`` /
``--per-key-tokens`` for each key's default (platform admins).
"""

from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.parse import urlencode

from inferflux.gateway.cli.client import add_client_options, admin_call, connect, list_all, raise_for_error, show
from inferflux.gateway.cli.common import EXIT_OK, ClientError, positive_int

_PRICE_COLUMNS = ("model", "prompt_usd_per_million", "completion_usd_per_million", "updated_at")
_BUDGET_COLUMNS = ("id", "name", "enabled", "spec")
_COUNTS = ("requests", "refused", "cancelled", "prompt_tokens", "completion_tokens", "cost_usd")
_FIELDS = {"tenant": "tenant_id", "key": "key_id", "model": "model"}


def _usage_query(args: argparse.Namespace, offset: int) -> str:
    query = {"tenant_id": args.tenant, "key_id": args.key, "model": args.model, "from": args.from_, "to": args.to,
             "group": args.group, "by": args.by, "limit": args.limit, "offset": offset or None}  # fmt: skip
    return urlencode({k: v for k, v in query.items() if v is not None})


def _usage(args: argparse.Namespace) -> int:
    if args.csv:
        with connect(args) as client:
            response = client.get(f"/admin/v1/usage?{_usage_query(args, 0)}&format=csv")
            raise_for_error(response)
            print(response.text, end="")
        return EXIT_OK
    rows: list[dict[str, Any]] = []
    offset = 0
    while True:
        page = admin_call(args, "GET", f"/usage?{_usage_query(args, offset)}")
        rows += page["data"]
        if not args.all or not page.get("next"):
            break
        offset += args.limit
    if args.json:
        return show(args, rows, ())
    columns = ("bucket", *(_FIELDS[g] for g in args.by.split(",") if g), *_COUNTS)
    for row in rows:  # the table shows the refusals' reasons in one cell
        row["refusals"] = ";".join(f"{reason}={n}" for reason, n in row.get("refusals", {}).items()) or None
    return show(args, rows, (*columns, "refusals"))


def _prices(args: argparse.Namespace) -> int:
    if args.action == "list":
        return show(args, admin_call(args, "GET", "/prices")["data"], _PRICE_COLUMNS)
    if args.action == "delete":
        admin_call(args, "DELETE", f"/prices/{args.model}")
        return _deleted(args, "the price of", args.model)
    body = {"prompt_usd_per_million": args.prompt, "completion_usd_per_million": args.completion}
    return show(args, admin_call(args, "PUT", f"/prices/{args.model}", body), _PRICE_COLUMNS)


def _deleted(args: argparse.Namespace, what: str, ident: str) -> int:
    print(json.dumps({"id": ident, "deleted": True}) if args.json else f"deleted {what} {ident}")
    return EXIT_OK


def _budget_spec(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if args.key:
        spec = {"scope": "key", "principal": args.key}
    if args.spend_usd is not None:
        spec["spend_usd"] = args.spend_usd
    if args.tokens is not None:
        spec["tokens"] = args.tokens
    per_key = {name: value for name, value in (("spend_usd", args.per_key_spend_usd), ("tokens", args.per_key_tokens))
               if value is not None}  # fmt: skip
    if per_key:
        spec["per_key"] = per_key
    if set(spec) <= {"scope", "principal"}:
        raise ClientError("give --spend-usd and/or --tokens (or the --per-key-... defaults)")
    return spec


def _budgets(args: argparse.Namespace) -> int:
    base = f"/tenants/{args.tenant}/policies"
    if args.action == "get":
        return show(args, [p for p in list_all(args, base) if p["kind"] == "budget"], _BUDGET_COLUMNS)
    if args.action == "delete":
        admin_call(args, "DELETE", f"{base}/{args.policy}")
        return _deleted(args, "budget", args.policy)
    name = f"budget:{args.key}" if args.key else "budget"
    spec = _budget_spec(args)
    existing = [p for p in list_all(args, base) if p["kind"] == "budget" and p["name"] == name]
    if existing:
        return show(args, admin_call(args, "PATCH", f"{base}/{existing[0]['id']}", {"spec": spec}), _BUDGET_COLUMNS)
    return show(args, admin_call(args, "POST", base, {"kind": "budget", "name": name, "spec": spec}), _BUDGET_COLUMNS)


def _common(parser: argparse.ArgumentParser) -> None:
    add_client_options(parser)
    parser.add_argument("--json", action="store_true", help="print the raw response")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``usage``, ``prices`` and ``budgets`` to ``subparsers`` (``inferctl admin``'s groups)."""
    usage = subparsers.add_parser("usage", help="usage and spend per day, hour or minute, by tenant, key or model",
                                  description=(__doc__ or "").split("\n\n", 1)[1].replace("``", "'"))  # fmt: skip
    usage.add_argument("--tenant", help="one tenant (tenant admins: their own, the default)")
    usage.add_argument("--key", help="one API key id")
    usage.add_argument("--model", help="one model")
    usage.add_argument("--from", dest="from_", metavar="TIME", help="buckets from this RFC 3339 time")
    usage.add_argument("--to", metavar="TIME", help="buckets before this RFC 3339 time")
    usage.add_argument("--group", choices=("day", "hour", "minute"), default="day",
                       help="bucket size: day, or hour or minute for the last 24 hours (default: day)")
    usage.add_argument("--by", default="tenant", help="comma-separated: tenant, key, model (default: tenant)")
    usage.add_argument("--limit", type=positive_int, default=100, help="rows per page (default: 100)")
    usage.add_argument("--all", action="store_true", help="follow every page")
    usage.add_argument("--csv", action="store_true", help="print the server's CSV")
    _common(usage)
    usage.set_defaults(handler=_usage)

    prices = subparsers.add_parser("prices", help="model prices per million tokens (platform admin)")
    actions = prices.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="the price table")
    put = actions.add_parser("set", help="set a model's price")
    delete = actions.add_parser("delete", help="delete a model's price")
    for sub in (put, delete):
        sub.add_argument("model", help="the model's name")
    put.add_argument("--prompt", required=True, metavar="USD", help="dollars per million prompt tokens, e.g. 0.15")
    put.add_argument("--completion", required=True, metavar="USD", help="dollars per million completion tokens")
    for sub in (listing, put, delete):
        _common(sub)
    prices.set_defaults(handler=_prices)

    budgets = subparsers.add_parser("budgets", help="a tenant's monthly spend and token budgets")
    actions = budgets.add_subparsers(dest="action", metavar="ACTION", required=True)
    get = actions.add_parser("get", help="a tenant's budgets")
    put = actions.add_parser("set", help="create or replace the tenant's (or --key's) budget (platform admin)")
    delete = actions.add_parser("delete", help="delete a budget by its policy id (platform admin)")
    for sub in (get, put, delete):
        sub.add_argument("tenant", help="tenant id")
    delete.add_argument("policy", help="the budget's policy id (pol_...)")
    put.add_argument("--key", metavar="KEY_ID", help="the budget of one API key, not the tenant's")
    put.add_argument("--spend-usd", metavar="USD", help="dollars a month, e.g. 250 or 99.50")
    put.add_argument("--tokens", type=positive_int, metavar="N", help="tokens a month")
    put.add_argument("--per-key-spend-usd", metavar="USD", help="each key's own monthly spend budget")
    put.add_argument("--per-key-tokens", type=positive_int, metavar="N", help="each key's own monthly tokens")
    for sub in (get, put, delete):
        _common(sub)
    budgets.set_defaults(handler=_budgets)
