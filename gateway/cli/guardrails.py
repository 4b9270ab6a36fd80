"""``inferctl admin guardrails``: guardrail policies on a running server (``/admin/v1/guardrails``).

A tenant admin manages its own tenant's policies (they can only make its
traffic stricter); a platform admin names another tenant with ``--tenant``,
or the global policies with ``--global``. A policy's ``spec`` (direction,
blocklist, pii, opa, decode: see docs/security.md) is JSON, inline or
``@file``. Its ``sensitive_spec`` (confidential blocklist rules, an OPA token)
is read from a file (``--sensitive-file``) or standard input
(``--sensitive-stdin``), never from the command line, and never shown again.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import urlencode

from inferflux.gateway.cli.client import add_client_options, admin_call, deleted, json_object, list_all, show
from inferflux.gateway.cli.common import ClientError

_COLUMNS = ("id", "name", "tenant_id", "enabled", "has_sensitive_spec", "updated_at")
_PATH = "/guardrails"


def _owner_query(args: argparse.Namespace) -> str:
    if args.global_:
        return "?" + urlencode({"global": "true"})
    return "?" + urlencode({"tenant_id": args.tenant}) if args.tenant else ""


def _sensitive(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.sensitive_stdin:
        return json_object(sys.stdin.read(), "--sensitive-stdin")
    if args.sensitive_file is not None:
        return json_object("@" + args.sensitive_file, "--sensitive-file")
    return None


def _changes(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if args.name is not None:
        body["name"] = args.name
    if args.spec is not None:
        body["spec"] = json_object(args.spec, "--spec")
    sensitive = _sensitive(args)
    if sensitive is not None:
        body["sensitive_spec"] = sensitive
    if args.enabled is not None:
        body["enabled"] = args.enabled
    return body


def _guardrails(args: argparse.Namespace) -> int:
    query = _owner_query(args)
    if args.action == "list":
        return show(args, list_all(args, _PATH + query), _COLUMNS)
    if args.action == "create":
        body = _changes(args)
        if "spec" not in body or "name" not in body:
            raise ClientError("create needs --name and --spec")
        if args.global_:
            body["tenant_id"] = None
        elif args.tenant:
            body["tenant_id"] = args.tenant
        return show(args, admin_call(args, "POST", _PATH, body), _COLUMNS)
    one = f"{_PATH}/{args.policy}{query}"
    if args.action == "show":
        record = admin_call(args, "GET", one)
        if not args.json:  # the spec is the point of showing one: print it under the table
            show(args, record, _COLUMNS)
            print(json.dumps(record.get("spec"), indent=2))
            return 0
        return show(args, record, _COLUMNS)
    if args.action == "update":
        return show(args, admin_call(args, "PATCH", one, _changes(args)), _COLUMNS)
    admin_call(args, "DELETE", one)
    return deleted(args, "guardrail policy", args.policy)


def _add_owner(parser: argparse.ArgumentParser) -> None:
    owner = parser.add_mutually_exclusive_group()
    owner.add_argument("--tenant", metavar="ID", help="platform admins: this tenant's policies (default: your own)")
    owner.add_argument("--global", dest="global_", action="store_true", help="platform admins: the global policies")


def _add_fields(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="what the policy is for")
    parser.add_argument("--spec", metavar="JSON", help="the policy (direction, blocklist, pii, opa, decode): JSON, "
                        "inline or @file")  # fmt: skip
    secret = parser.add_mutually_exclusive_group()
    secret.add_argument("--sensitive-file", metavar="FILE", help="write-only JSON stored encrypted (confidential "
                        "blocklist rules, opa_token)")  # fmt: skip
    secret.add_argument("--sensitive-stdin", action="store_true", help="the same, read from standard input")
    enabled = parser.add_mutually_exclusive_group()
    enabled.add_argument("--enable", dest="enabled", action="store_const", const=True)
    enabled.add_argument("--disable", dest="enabled", action="store_const", const=False,
                         help="keep the policy but stop applying it")  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``guardrails list|create|show|update|delete`` to ``subparsers``."""
    parser = subparsers.add_parser(
        "guardrails",
        help="manage guardrail policies (blocklists, PII, OPA) on a running server (a tenant admin: its tenant's)",
        description=(__doc__ or "").split("\n\n", 1)[1].replace("``", "'"),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("list", help="list the policies")
    _add_fields(actions.add_parser("create", help="create a policy (--name and --spec)"))
    for action, text in (("show", "show one policy and its spec"), ("delete", "delete a policy")):
        actions.add_parser(action, help=text).add_argument("policy", help="policy id (pol_...)")
    update = actions.add_parser("update", help="change a policy (only the fields given)")
    update.add_argument("policy", help="policy id (pol_...)")
    _add_fields(update)
    for sub in actions.choices.values():
        _add_owner(sub)
        add_client_options(sub)
        sub.add_argument("--json", action="store_true", help="print the raw response")
    parser.set_defaults(handler=_guardrails)
    return parser
