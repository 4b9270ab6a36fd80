"""The policy store's commands, run beside the servers on the store itself (no server needed).

``inferctl db upgrade|downgrade|current`` (the schema), ``inferctl admin
rotate-key`` (the encryption key) and ``inferctl audit verify`` (the hash
chains; ``policy.audit.cli``, given this module's store access for
``--checkpoints``). They read the same settings as ``serve``. SQLAlchemy and
Alembic are imported when a command runs: ``--help`` does not need them.
"""

from __future__ import annotations

import argparse
import functools
import getpass
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from inferflux.gateway.cli.common import EXIT_OK, ClientError, positive_int
from inferflux.gateway.cli.progress import Progress
from inferflux.gateway.settings import ConfigError, Settings, ensure_data_dir, load_settings
from inferflux.policy.audit.cli import add_audit_parser  # stdlib only: --help stays fast
from inferflux.policy.errors import PolicyError, StoreConfigError

if TYPE_CHECKING:  # SQLAlchemy is imported by the store commands only
    from sqlalchemy import Engine


def _audit_checkpoint(args: argparse.Namespace, chain_id: str) -> tuple[Any, Any]:
    """``audit verify --checkpoints``: the latest signed checkpoint of ``chain_id`` in the configured store,
    and the signer (its key derived from the store's secret) that checks it. OSError if the store cannot be read."""
    from sqlalchemy.exc import SQLAlchemyError

    from inferflux.policy.audit.checkpoint import CHECKPOINT_PURPOSE, CheckpointSigner
    from inferflux.policy.audit.store import AuditStore
    from inferflux.policy.store import PolicyStore

    try:
        settings = _store_settings(args)
        store = PolicyStore.open(settings.store, settings.data_dir)
        try:
            signer = CheckpointSigner(store.derive_secret(CHECKPOINT_PURPOSE))
            return AuditStore(store.engine).latest_checkpoint(chain_id), signer
        finally:
            store.close()
    except (ConfigError, StoreConfigError, SQLAlchemyError, PolicyError) as exc:
        raise OSError(f"the policy store: {getattr(exc, 'orig', None) or exc}") from None


def _store_command(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report the store's failures in one line: a wrong key, an unreachable database, a bad path."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            return handler(args)
        except (StoreConfigError, OSError) as exc:
            raise ClientError(str(exc)) from None
        except SQLAlchemyError as exc:
            raise ClientError(f"the policy store failed: {getattr(exc, 'orig', None) or exc}") from None

    return run


def _store_settings(args: argparse.Namespace) -> Settings:
    """The same settings ``serve`` reads (file, environment, --data-dir); ConfigError if invalid."""
    settings = load_settings(args.config, overrides={"data_dir": args.data_dir})
    ensure_data_dir(settings.data_dir)
    # Warnings only: a generated key file must be reported, Alembic's progress need not be.
    logging.basicConfig(level=logging.WARNING, format="inferctl: %(levelname)s: %(message)s")
    return settings


@contextmanager
def _store_engine(args: argparse.Namespace) -> Iterator[tuple[Engine, str]]:
    """An engine on the configured store, and how to name it (without a password)."""
    # Imported here, like the server: SQLAlchemy and Alembic are not needed for --help.
    from inferflux.policy.store.db import create_store_engine, describe_url

    settings = _store_settings(args)
    url = settings.store.database_url(settings.data_dir)
    engine = create_store_engine(url, settings.store)
    try:
        yield engine, describe_url(url)
    finally:
        engine.dispose()


def _print_revision(engine: Engine, where: str, as_json: bool = False) -> None:
    from inferflux.policy.store import migrate

    revision, head = migrate.current(engine), migrate.head()
    if as_json:
        print(json.dumps({"store": where, "revision": revision, "head": head, "at_head": revision == head}))
        return
    state = "head" if revision == head else f"head is {head}"
    print(f"{where}: revision {revision or 'none (empty)'} ({state})")


@_store_command
def _db_migrate(args: argparse.Namespace) -> int:
    """``db upgrade`` or ``db downgrade`` (``args.direction``) to ``args.revision``."""
    from inferflux.policy.store import migrate

    step = migrate.upgrade if args.direction == "upgrade" else migrate.downgrade
    with _store_engine(args) as (engine, where):
        step(engine, args.revision)
        _print_revision(engine, where, args.json)
    return EXIT_OK


@_store_command
def _db_current(args: argparse.Namespace) -> int:
    with _store_engine(args) as (engine, where):
        _print_revision(engine, where, args.json)
    return EXIT_OK


def _new_passphrase() -> str:
    passphrase = os.environ.get("INFERFLUX_STORE_NEW_PASSPHRASE")
    if passphrase:
        return passphrase
    if not sys.stdin.isatty():
        raise ClientError("--new-passphrase: set INFERFLUX_STORE_NEW_PASSPHRASE, or run on a terminal to be asked")
    passphrase = getpass.getpass("New store passphrase: ")
    if not passphrase:
        raise ClientError("the new passphrase is empty")
    if getpass.getpass("Repeat it: ") != passphrase:
        raise ClientError("the passphrases differ")
    return passphrase


@_store_command
def _rotate_key(args: argparse.Namespace) -> int:
    from inferflux.policy.store import PolicyStore

    settings = _store_settings(args)
    new_passphrase = _new_passphrase() if args.new_passphrase else None

    # -v: a line per table; on a terminal without --json (or -v): a progress line that is redrawn.
    bar = Progress("re-encrypting", enabled=not (args.json or args.verbose))

    def progress(table: str, rows: int) -> None:
        bar.update(f"{table}: {rows} rows")
        if rows and args.verbose:
            print(f"  {table}: {rows} rows re-encrypted", file=sys.stderr)

    with bar, PolicyStore.open(settings.store, settings.data_dir) as store:
        report = store.rotate_key(
            new_passphrase=new_passphrase, prune=args.prune, batch_size=args.batch_size, on_progress=progress
        )
    if args.json:
        print(json.dumps({"active_version": report.active_version, "values": report.values, "rows": report.rows,
                          "pruned_versions": list(report.pruned_versions),
                          "previous_versions": list(report.previous_versions),
                          "restart_with_new_passphrase": new_passphrase is not None}))  # fmt: skip
        return EXIT_OK
    print(
        f"key version {report.active_version} is active; "
        f"re-encrypted {report.values} secret(s) in {report.rows} row(s)"
    )
    if report.pruned_versions:
        print(f"removed key {_versions(report.pruned_versions)}")
    elif report.previous_versions:
        kept = _versions(report.previous_versions)
        print(
            f"key {kept} {'are' if len(report.previous_versions) > 1 else 'is'} kept to read backups made before "
            "this rotation; the next rotation with --prune removes them"
        )
    if new_passphrase is not None:
        print("restart every server with the new passphrase (INFERFLUX_STORE_PASSPHRASE)")
    return EXIT_OK


def _versions(numbers: Sequence[int]) -> str:
    return ("versions " if len(numbers) > 1 else "version ") + ", ".join(map(str, numbers))


def add_store_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML settings file, as for serve (env: INFERFLUX_CONFIG)")
    parser.add_argument(
        "--data-dir", metavar="DIR", help="state directory, as for serve (env: INFERFLUX_DATA_DIR)"
    )



def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``db``, ``admin`` and ``audit`` to ``inferctl``'s commands."""
    db = sub.add_parser("db", help="migrate the policy store's schema")
    db_sub = db.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    upgrade = db_sub.add_parser("upgrade", help="migrate the schema to this release's (or --revision)")
    upgrade.add_argument("--revision", default="head", help="target revision (default: %(default)s)")
    upgrade.set_defaults(handler=_db_migrate, direction="upgrade")
    downgrade = db_sub.add_parser(
        "downgrade", help="migrate the schema back to --revision ('base' drops every table and all data)"
    )
    downgrade.add_argument("--revision", required=True, help="target revision, e.g. 0001 or base")
    downgrade.set_defaults(handler=_db_migrate, direction="downgrade")
    current = db_sub.add_parser("current", help="show the schema's revision")
    current.set_defaults(handler=_db_current)
    for command in (upgrade, downgrade, current):
        add_store_options(command)
        command.add_argument("--json", action="store_true", help="print the revision as JSON")

    admin = sub.add_parser(
        "admin",
        help="administer: the policy store directly (rotate-key), or a running server's models, guardrails, "
        "limits, oidc, credentials over its API",
    )
    admin_sub = admin.add_subparsers(dest="admin_command", metavar="COMMAND", required=True)
    rotate = admin_sub.add_parser(
        "rotate-key",
        help="re-encrypt the store's secrets with a new key",
        description=(
            "Add a new key version (to the key file, or from the passphrase with a new salt), make it "
            "active, and re-encrypt every secret in small transactions. Safe while servers run: they "
            "pick the new version up from the key file or the store. Old versions stay in the key file, "
            "to read backups made before the rotation, until --prune."
        ),
    )
    rotate.add_argument("--prune", action="store_true", help="then remove every old key version")
    rotate.add_argument(
        "--new-passphrase",
        action="store_true",
        help="derive the new key from a new passphrase ($INFERFLUX_STORE_NEW_PASSPHRASE, or asked for); "
        "servers must then be restarted with it",
    )
    rotate.add_argument(
        "--batch-size", type=positive_int, default=200, help="rows per transaction (default: %(default)s)"
    )
    rotate.add_argument("-v", "--verbose", action="store_true", help="report progress per table")
    rotate.add_argument("--json", action="store_true", help="print the report as JSON")
    add_store_options(rotate)
    rotate.set_defaults(handler=_rotate_key)

    add_audit_parser(sub, store_options=add_store_options, load_checkpoint=_audit_checkpoint)
