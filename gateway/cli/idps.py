"""``inferctl idps``: OIDC identity providers on a running server (``/admin/v1/oidc-providers``).

A tenant admin manages its own tenant's providers (they sign users into that
tenant only); a platform admin manages every one, and alone registers
platform-owned providers (``--platform``) with the tenants they may map users
into (``--tenants``) and, with ``--allow-platform``, the platform tenant.
"""

from __future__ import annotations

import argparse
from typing import Any

from inferflux.gateway.cli.client import add_client_options, admin_call, deleted, list_all, show
from inferflux.gateway.cli.common import ClientError

_COLUMNS = ("id", "name", "tenant_id", "tenant_ids", "allow_platform", "issuer", "audience", "enabled")
_PATH = "/oidc-providers"


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [item for item in value.split(",") if item]


def _role_map(value: str | None) -> dict[str, str] | None:
    """``claim=role,claim=role`` as the API's role_map."""
    if value is None:
        return None
    pairs = [item.partition("=") for item in value.split(",") if item]
    if any(not claim or not sep or not role for claim, sep, role in pairs):
        raise ClientError("--role-map takes claim=role pairs separated by commas, e.g. admin=tenant-admin,dev=member")
    return {claim: role for claim, _, role in pairs}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The fields both create and update take, as given (None: not given)."""
    values = {
        "tenant_ids": _csv(args.tenants),
        "allow_platform": args.allow_platform,
        "role_map": _role_map(args.role_map),
        "jwks_uri": args.jwks_uri,
        "tenant_claim": args.tenant_claim,
        "roles_claim": args.roles_claim,
        "enabled": args.enabled,
    }
    return {name: value for name, value in values.items() if value is not None}


def _create_body(args: argparse.Namespace) -> dict[str, Any]:
    body = {"name": args.name, "issuer": args.issuer, "audience": args.audience, **_settings(args)}
    if args.platform:
        body["tenant_id"] = None
    elif args.tenant is not None:
        body["tenant_id"] = args.tenant
    return body


def _idps(args: argparse.Namespace) -> int:
    if args.action == "list":
        return show(args, list_all(args, _PATH), _COLUMNS)
    if args.action == "create":
        return show(args, admin_call(args, "POST", _PATH, _create_body(args)), _COLUMNS)
    if args.action == "show":
        return show(args, admin_call(args, "GET", f"{_PATH}/{args.provider}"), _COLUMNS)
    if args.action == "update":
        return show(args, admin_call(args, "PATCH", f"{_PATH}/{args.provider}", _settings(args)), _COLUMNS)
    admin_call(args, "DELETE", f"{_PATH}/{args.provider}")
    return deleted(args, "identity provider (and its role bindings)", args.provider)


def _add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", metavar="IDS", help="platform-owned only: comma-separated tenant ids it may "
                        "sign users into (replaces the list)")  # fmt: skip
    allow = parser.add_mutually_exclusive_group()
    allow.add_argument("--allow-platform", dest="allow_platform", action="store_const", const=True,
                       help="platform-owned only: may sign users into the platform tenant, platform-admin too")  # fmt: skip
    allow.add_argument("--no-allow-platform", dest="allow_platform", action="store_const", const=False)
    parser.add_argument("--role-map", metavar="PAIRS", help="claim=role,... (roles: tenant-admin, member, viewer; "
                        "platform-admin with --allow-platform)")  # fmt: skip
    parser.add_argument("--jwks-uri", help="where its keys are, if not in its discovery document")
    parser.add_argument("--tenant-claim", help="the claim naming the tenant (default: tenant)")
    parser.add_argument("--roles-claim", help="the claim holding roles (default: roles)")
    enabled = parser.add_mutually_exclusive_group()
    enabled.add_argument("--enable", dest="enabled", action="store_const", const=True)
    enabled.add_argument("--disable", dest="enabled", action="store_const", const=False,
                         help="stop accepting its tokens (every replica within seconds)")  # fmt: skip


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str = "idps"
) -> argparse.ArgumentParser:
    """Add ``idps list|create|show|update|delete`` to ``inferctl``'s subcommands."""
    idps = subparsers.add_parser(
        name,
        help="manage OIDC identity providers on a running server (a tenant admin: its tenant's)",
        description=__doc__.split("\n\n", 1)[1].replace("``", "'"),
    )
    actions = idps.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("list", help="list the providers you may manage")
    create = actions.add_parser("create", help="register a provider")
    create.add_argument("--name", required=True, help="lower-case slug, unique per owner")
    create.add_argument("--issuer", required=True, help="the tokens' 'iss' (https; http only on loopback)")
    create.add_argument("--audience", required=True, help="the tokens' 'aud' for this service")
    owner = create.add_mutually_exclusive_group()
    owner.add_argument("--tenant", metavar="ID", help="the owning tenant (default: your own; platform admins: "
                       "the platform, as --platform)")  # fmt: skip
    owner.add_argument("--platform", action="store_true", help="platform-owned (platform admins)")
    _add_settings(create)
    for action, text in (("show", "show one provider"), ("delete", "delete a provider and its role bindings")):
        actions.add_parser(action, help=text).add_argument("provider", help="provider id (idp_...)")
    update = actions.add_parser("update", help="change a provider (its owner never changes)")
    update.add_argument("provider", help="provider id (idp_...)")
    _add_settings(update)
    for parser in actions.choices.values():
        add_client_options(parser)
        parser.add_argument("--json", action="store_true", help="print the raw response")
    idps.set_defaults(handler=_idps)
    return idps
