"""``inferctl audit verify``: check the hash chains of a spool or of delivered JSON-lines files.

``gateway/cli.py`` registers it with ``add_audit_parser(subparsers)``. Exit
status 0 when every chain verifies, 1 when one does not (the first bad record
is named), 2 when the input cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a command runs: ``inferctl --help`` loads only this module
    from policy.audit.chain import VerifyReport

EXIT_OK, EXIT_TAMPERED, EXIT_UNREADABLE = 0, 1, 2


def verify_spool(directory: str | Path) -> VerifyReport:
    """Verify a spool directory's segments in order; a spool holds no duplicates, so none are allowed.

    Reads without the spool's lock, so it can run beside the gateway that writes it.
    """
    from policy.audit.chain import verify_lines
    from policy.audit.spool import segment_files

    directory = Path(directory)
    if not (directory / "segments").is_dir():
        raise FileNotFoundError(f"{directory} is not an audit spool (no segments directory)")
    return verify_lines(_lines(segment_files(directory)), allow_duplicates=False)


def verify_files(paths: Sequence[str | Path], *, allow_duplicates: bool = True) -> VerifyReport:
    """Verify JSON-lines files (a file sink's output, oldest first), skipping identical re-deliveries."""
    from policy.audit.chain import verify_lines

    return verify_lines(_lines([Path(p) for p in paths]), allow_duplicates=allow_duplicates)


def _lines(paths: Sequence[Path]) -> Iterator[tuple[str, bytes]]:
    for path in paths:
        with path.open("rb") as f:
            for number, line in enumerate(f, start=1):
                stripped = line.rstrip(b"\r\n")
                if stripped:
                    yield f"{path.name} line {number}", stripped


def add_audit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``audit verify`` to ``inferctl``'s subcommands; returns the ``audit`` parser."""
    audit = subparsers.add_parser("audit", help="check the tamper-evident audit trail")
    audit_sub = audit.add_subparsers(dest="audit_command", metavar="COMMAND", required=True)
    verify = audit_sub.add_parser(
        "verify",
        help="verify the hash chains of an audit spool or of delivered JSON-lines files",
        description=(
            "Check that no audit record was changed, removed, inserted or reordered: every record's hash "
            "must match its content and name the hash of the record before it, per chain (one per gateway "
            "replica). Exit status 0: verified; 1: the first bad record is printed; 2: unreadable input."
        ),
    )
    source = verify.add_mutually_exclusive_group(required=True)
    source.add_argument("--spool", type=Path, metavar="DIR", help="a gateway's audit spool directory")
    source.add_argument(
        "--file", type=Path, metavar="JSONL", action="append",
        help="a file sink's output (repeat for rotated files, oldest first); identical re-deliveries are skipped",
    )  # fmt: skip
    verify.set_defaults(handler=run_verify)
    return audit


def run_verify(args: argparse.Namespace) -> int:
    try:
        report = verify_spool(args.spool) if args.spool is not None else verify_files(args.file)
    except OSError as exc:
        print(f"inferctl: error: cannot read the audit trail: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(format_report(report))
    return EXIT_OK if report.ok else EXIT_TAMPERED


def format_report(report: VerifyReport) -> str:
    lines = []
    for chain in report.chains:
        note = " (earlier records pruned)" if chain.pruned_before else ""
        lines.append(
            f"chain {chain.chain}: seq {chain.first_seq}..{chain.last_seq}, {chain.records} records, "
            f"head {chain.last_hash}{note}"
        )
    if report.duplicates:
        lines.append(f"{report.duplicates} identical re-delivered records skipped")
    if report.problem is not None:
        lines.append(f"TAMPERED: {report.problem}")
    else:
        lines.append(f"OK: {len(report.chains)} chain(s), {report.records} records verified")
    return "\n".join(lines)
