"""Client commands of the admin API: ``inferctl whoami``, ``tenants`` and ``keys`` (``idps``: ``gateway.cli.idps``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from inferflux.gateway.cli.client import add_client_options, admin_call, deleted, list_all, show
from inferflux.gateway.cli.common import EXIT_OK, positive_int

_TENANT_COLUMNS = ("id", "name", "display_name", "disabled", "allowed_models")
_KEY_COLUMNS = ("id", "prefix", "name", "role", "expires_at", "revoked_at", "last_used_at")


def _models_list(value: str | None) -> list[str] | None:
    return None if value is None else [m.strip() for m in value.split(",") if m.strip()]


def _whoami(args: argparse.Namespace) -> int:
    return show(args, admin_call(args, "GET", "/whoami"), ("tenant", "subject", "roles", "scopes"))


def _tenants(args: argparse.Namespace) -> int:
    if args.action == "list":
        return show(args, list_all(args, "/tenants"), _TENANT_COLUMNS)
    if args.action == "create":
        body = {"name": args.name, "display_name": args.display_name, "allowed_models": _models_list(args.models)}
        return show(args, admin_call(args, "POST", "/tenants", body), _TENANT_COLUMNS)
    if args.action == "disable":
        return show(args, admin_call(args, "PATCH", f"/tenants/{args.tenant}", {"disabled": True}), _TENANT_COLUMNS)
    if args.action == "enable":
        return show(args, admin_call(args, "PATCH", f"/tenants/{args.tenant}", {"disabled": False}), _TENANT_COLUMNS)
    admin_call(args, "DELETE", f"/tenants/{args.tenant}")
    return deleted(args, "tenant", args.tenant)


def _print_new_key(args: argparse.Namespace, record: dict[str, Any]) -> int:
    if args.json:
        print(json.dumps(record, indent=2))
        return EXIT_OK
    # The key alone on stdout, so it can be captured; what it is, on stderr.
    print(f"{record['role']} key {record['id']} (prefix {record['prefix']}); shown only now:", file=sys.stderr)
    print(record["key"])
    return EXIT_OK


def _keys(args: argparse.Namespace) -> int:
    base = f"/tenants/{args.tenant}/keys"
    if args.action == "list":
        return show(args, list_all(args, base), _KEY_COLUMNS)
    if args.action == "create":
        body = {
            "name": args.name,
            "role": args.role,
            "allowed_models": _models_list(args.models),
            "expires_in_seconds": args.expires_in,
        }
        return _print_new_key(args, admin_call(args, "POST", base, body))
    if args.action == "rotate":
        return _print_new_key(
            args, admin_call(args, "POST", f"{base}/{args.key_id}/rotate", {"grace_seconds": args.grace})
        )
    return show(args, admin_call(args, "POST", f"{base}/{args.key_id}/revoke"), _KEY_COLUMNS)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``whoami``, ``tenants`` and ``keys`` to ``inferctl``'s commands."""
    whoami = sub.add_parser("whoami", help="show who the API key belongs to and what it may do")
    add_client_options(whoami)
    whoami.add_argument("--json", action="store_true", help="print the raw response")
    whoami.set_defaults(handler=_whoami)

    tenants = sub.add_parser("tenants", help="manage tenants on a running server (platform admin)")
    tenants_sub = tenants.add_subparsers(dest="action", metavar="ACTION", required=True)
    tenants_sub.add_parser("list", help="list every tenant")
    create_tenant = tenants_sub.add_parser("create", help="create a tenant")
    create_tenant.add_argument("name", help="lower-case slug: a-z, 0-9, '-'")
    create_tenant.add_argument("--display-name")
    create_tenant.add_argument("--models", help="comma-separated model allow-list (default: every model)")
    for action, text in (("disable", "stop every key and token of a tenant"), ("enable", "undo disable"),
                         ("delete", "delete a tenant with its keys and bindings")):
        tenants_sub.add_parser(action, help=text).add_argument("tenant", help="tenant id")
    for action_parser in tenants_sub.choices.values():
        add_client_options(action_parser)
        action_parser.add_argument("--json", action="store_true", help="print the raw response")
    tenants.set_defaults(handler=_tenants)

    keys = sub.add_parser("keys", help="manage a tenant's API keys on a running server")
    keys_sub = keys.add_subparsers(dest="action", metavar="ACTION", required=True)
    keys_sub.add_parser("list", help="list a tenant's keys (prefixes only)").add_argument("tenant", help="tenant id")
    create_key = keys_sub.add_parser("create", help="create a key; it is printed on stdout, once")
    create_key.add_argument("tenant", help="tenant id")
    create_key.add_argument("--name", required=True, help="what the key is for")
    create_key.add_argument("--role", required=True, choices=["platform-admin", "tenant-admin", "member", "viewer"])
    create_key.add_argument("--models", help="comma-separated: narrows the tenant's model allow-list")
    create_key.add_argument("--expires-in", type=positive_int, metavar="SECONDS", help="lifetime (default: none)")
    rotate_key = keys_sub.add_parser("rotate", help="replace a key; the old one works for --grace seconds more")
    rotate_key.add_argument("tenant", help="tenant id")
    rotate_key.add_argument("key_id", help="key id (key_...)")
    rotate_key.add_argument("--grace", type=int, default=3600, help="seconds (default: %(default)s)")
    revoke_key = keys_sub.add_parser("revoke", help="revoke a key now (every replica within seconds)")
    revoke_key.add_argument("tenant", help="tenant id")
    revoke_key.add_argument("key_id", help="key id (key_...)")
    for action_parser in keys_sub.choices.values():
        add_client_options(action_parser)
        action_parser.add_argument("--json", action="store_true", help="print the raw response")
    keys.set_defaults(handler=_keys)
