"""``inferctl credentials``: upstream credentials on a running server (``/admin/v1/credentials``, platform admins).

A model of the openai backend names the credential it presents to its
upstream (upstream.credential: NAME). The secret is read from standard input
(--secret-stdin), from an environment variable (--secret-env VAR) or, on a
terminal, from a prompt; never from the command line, where other users of
the host would see it in the process list. The server never shows it again.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys

from inferflux.gateway.cli.client import add_client_options, admin_call, deleted, list_all, show
from inferflux.gateway.cli.common import ClientError

_COLUMNS = ("id", "name", "created_at", "updated_at")
_PATH = "/credentials"


def read_secret(args: argparse.Namespace) -> str:
    """The secret from ``--secret-stdin``, ``--secret-env``, or a prompt on a terminal."""
    if args.secret_stdin:
        secret = sys.stdin.read().rstrip("\r\n")  # the newline echo or a file ends with is not part of it
        where = "standard input"
    elif args.secret_env is not None:
        secret = os.environ.get(args.secret_env, "")
        where = f"${args.secret_env}"
    elif sys.stdin.isatty():
        secret = getpass.getpass("Secret (not echoed): ")
        where = "the prompt"
    else:
        raise ClientError("give the secret with --secret-stdin or --secret-env VAR (never on the command line)")
    if not secret:
        raise ClientError(f"the secret from {where} is empty")
    return secret


def _credentials(args: argparse.Namespace) -> int:
    if args.action == "list":
        return show(args, list_all(args, _PATH), _COLUMNS)
    if args.action == "create":
        body = {"name": args.name, "secret": read_secret(args)}
        return show(args, admin_call(args, "POST", _PATH, body), _COLUMNS)
    if args.action == "show":
        return show(args, admin_call(args, "GET", f"{_PATH}/{args.credential}"), _COLUMNS)
    if args.action == "rotate":
        body = {"secret": read_secret(args)}
        return show(args, admin_call(args, "POST", f"{_PATH}/{args.credential}/rotate", body), _COLUMNS)
    admin_call(args, "DELETE", f"{_PATH}/{args.credential}")
    return deleted(args, "credential", args.credential)


def _add_secret_options(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--secret-stdin", action="store_true",
                        help="read the secret from standard input (a trailing newline is dropped)")  # fmt: skip
    source.add_argument("--secret-env", metavar="VAR", help="read the secret from environment variable VAR")


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str = "credentials"
) -> argparse.ArgumentParser:
    """Add ``credentials list|create|show|rotate|delete`` to ``inferctl``'s subcommands."""
    credentials = subparsers.add_parser(
        name,
        help="manage the upstream credentials of a running server (platform admin)",
        description=(__doc__ or "").split("\n\n", 1)[1].replace("``", "'"),
    )
    actions = credentials.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("list", help="list the credentials (never their secrets)")
    create = actions.add_parser("create", help="store a credential (its secret: --secret-stdin, --secret-env, "
                                "or asked for on a terminal)")  # fmt: skip
    create.add_argument("--name", required=True, help="lower-case slug that models' upstream.credential names")
    _add_secret_options(create)
    rotate = actions.add_parser("rotate", help="replace a credential's secret (its id and name stay)")
    rotate.add_argument("credential", help="credential id (cred_...)")
    _add_secret_options(rotate)
    for action, text in (("show", "show one credential (not its secret)"), ("delete", "delete a credential")):
        actions.add_parser(action, help=text).add_argument("credential", help="credential id (cred_...)")
    for parser in actions.choices.values():
        add_client_options(parser)
        parser.add_argument("--json", action="store_true", help="print the raw response")
    credentials.set_defaults(handler=_credentials)
    return credentials
