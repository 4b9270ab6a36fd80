"""``inferctl``: run the server, administer its store, and small clients for a running one.

A module per audience: ``operator`` (``serve``, ``backends``), ``store``
(``db``, ``admin rotate-key``, ``audit verify``: on the policy store itself,
no server needed), and the clients of a running server: ``status``,
``generate`` (``models``, ``complete``, ``chat``; ``interactive``: ``chat
--interactive``), ``admin_api`` (``whoami``, ``tenants``, ``keys``), ``idps``,
``credentials`` and ``served_models`` (also as ``admin oidc|credentials|models``),
``guardrails`` and ``limits`` (``admin guardrails|limits``), ``usage`` (``admin
usage|prices|budgets``), ``audit_tail``
(``audit tail``), over ``client`` (the connection, errors, tables) and
``progress`` (a progress line on a terminal). ``completion`` prints shell
completion from this parser. ``common`` holds the exit codes and the one-line
error every command reports with.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import httpx

from inferflux.gateway.cli import (
    admin_api,
    audit_tail,
    completion,
    credentials,
    generate,
    guardrails,
    idps,
    limits,
    operator,
    served_models,
    status,
    store,
    usage,
)
from inferflux.gateway.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, ClientError, print_error, subparsers_of
from inferflux.gateway.settings import ConfigError

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "ClientError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferctl",
        description="InferFlux: an OpenAI-compatible LLM inference gateway.",
        epilog="Run 'inferctl COMMAND --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # The order of 'inferctl --help': the server, the clients, then the store.
    operator.add_parsers(sub)
    status.add_parser(sub)
    generate.add_models_parser(sub)
    admin_api.add_parsers(sub)
    idps.add_parser(sub)
    credentials.add_parser(sub)
    served_models.add_parser(sub)
    generate.add_generation_parsers(sub)
    store.add_parsers(sub)
    _add_admin_api_groups(sub.choices["admin"])
    audit_tail.add_parser(sub.choices["audit"])
    completion.add_parser(sub, parser)
    return parser


def _add_admin_api_groups(admin: argparse.ArgumentParser) -> None:
    """``inferctl admin``'s groups over a running server's API, beside ``rotate-key`` (the store itself).

    ``models``, ``oidc`` and ``credentials`` are the top-level ``served-models``,
    ``idps`` and ``credentials`` under the names the admin group gives them.
    """
    groups = subparsers_of(admin)
    served_models.add_parser(groups, "models")
    guardrails.add_parser(groups)
    limits.add_parser(groups)
    idps.add_parser(groups, "oidc")
    credentials.add_parser(groups, "credentials")
    usage.add_parser(groups)  # usage, prices, budgets


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except httpx.HTTPError as exc:
        print_error(f"cannot reach {getattr(args, 'url', 'the server')}: {exc}")
        return EXIT_FAILURE
    except ClientError as exc:
        print_error(str(exc))
        return EXIT_FAILURE
    except ConfigError as exc:
        print_error(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
