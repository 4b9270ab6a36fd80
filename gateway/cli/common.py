"""What every ``inferctl`` command shares: exit codes, the one-line error, argument types."""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # argparse's own code for bad usage; bad configuration is the same kind of mistake


class ClientError(Exception):
    """A command failed in a way worth one line, not a traceback."""


def print_error(message: str) -> None:
    print(f"inferctl: error: {message}", file=sys.stderr)


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {value!r}")
    return number


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (aliases included); empty for a leaf command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def subparsers_of(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """The action holding a parser's subcommands, to add more to it (the parser must have them)."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
