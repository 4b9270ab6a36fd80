"""``inferctl``: run the server, administer its store, and small clients for a running one.

A module per audience: ``operator`` (``serve``, ``backends``), ``store``
(``db``, ``admin``, ``audit``: on the policy store itself, no server needed),
and the clients of a running server: ``generate`` (``models``, ``complete``,
``chat``, ``embed``), ``admin_api`` (``whoami``, ``tenants``, ``keys``), ``idps``,
``credentials`` and ``served_models``, over ``client`` (the connection, errors, tables). ``common`` holds the exit
codes and the one-line error every command reports with.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import httpx

from gateway.cli import admin_api, credentials, generate, idps, operator, served_models, store
from gateway.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, ClientError, print_error
from gateway.settings import ConfigError

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
    generate.add_models_parser(sub)
    admin_api.add_parsers(sub)
    idps.add_parser(sub)
    credentials.add_parser(sub)
    served_models.add_parser(sub)
    generate.add_generation_parsers(sub)
    store.add_parsers(sub)
    return parser


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
