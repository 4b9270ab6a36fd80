"""``inferctl audit verify``: check the hash chains of a spool or of delivered JSON-lines files.

``gateway/cli/store.py`` registers it with ``add_audit_parser(subparsers, ...)``.
Exit status 0 when every chain verifies, 1 when one does not (the first bad
record is named) or a spool's tail is shorter than its latest signed
checkpoint (``--checkpoints``: how many records are missing is said), 2 when
the input cannot be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a command runs: ``inferctl --help`` loads only this module
    from inferflux.policy.audit.chain import VerifyReport
    from inferflux.policy.audit.checkpoint import Checkpoint, CheckpointSigner

# (parsed arguments, chain id) -> (that chain's latest checkpoint or None, the signer that checks it)
CheckpointLoader = Callable[[argparse.Namespace, str], "tuple[Checkpoint | None, CheckpointSigner]"]

EXIT_OK, EXIT_TAMPERED, EXIT_UNREADABLE = 0, 1, 2


def verify_spool(
    directory: str | Path, *, checkpoint: Checkpoint | None = None, signer: CheckpointSigner | None = None
) -> VerifyReport:
    """Verify a spool directory's segments in order; a spool holds no duplicates, so none are allowed.

    With ``checkpoint`` (the latest of the spool's chain, checked with
    ``signer``) the spool must also still reach it: a cut tail is reported
    with how many records are missing. Reads without the spool's lock, so it
    can run beside the gateway that writes it.
    """
    from dataclasses import replace

    from inferflux.policy.audit.chain import verify_lines
    from inferflux.policy.audit.checkpoint import check_tail
    from inferflux.policy.audit.spool import segment_files

    directory = Path(directory)
    if not (directory / "segments").is_dir():
        raise FileNotFoundError(f"{directory} is not an audit spool (no segments directory)")
    watch = {checkpoint.chain: checkpoint.seq} if checkpoint is not None else None
    report = verify_lines(_lines(segment_files(directory)), allow_duplicates=False, watch=watch)
    if checkpoint is None or not report.ok:
        return report
    if signer is None:
        raise ValueError("checking a checkpoint needs its signer")
    summary = next((c for c in report.chains if c.chain == checkpoint.chain), None)
    problem = check_tail(summary, checkpoint, report.watched.get(checkpoint.chain), signer)
    return replace(report, problem=problem, checkpoint=checkpoint)


def spool_chain_id(directory: str | Path) -> str:
    """The chain id a spool directory was created for (its ``chain`` file)."""
    return (Path(directory) / "chain").read_text().strip()


def verify_files(paths: Sequence[str | Path], *, allow_duplicates: bool = True) -> VerifyReport:
    """Verify JSON-lines files (a file sink's output, oldest first), skipping identical re-deliveries."""
    from inferflux.policy.audit.chain import verify_lines

    return verify_lines(_lines([Path(p) for p in paths]), allow_duplicates=allow_duplicates)


def _lines(paths: Sequence[Path]) -> Iterator[tuple[str, bytes]]:
    for path in paths:
        with path.open("rb") as f:
            for number, line in enumerate(f, start=1):
                stripped = line.rstrip(b"\r\n")
                if stripped:
                    yield f"{path.name} line {number}", stripped


def add_audit_parser(
    subparsers: Any,
    *,
    store_options: Callable[[argparse.ArgumentParser], None] | None = None,
    load_checkpoint: CheckpointLoader | None = None,
) -> argparse.ArgumentParser:
    """Add ``audit verify`` to ``inferctl``'s subcommands; returns the ``audit`` parser.

    ``store_options`` adds the options naming the policy store and
    ``load_checkpoint`` reads a chain's latest checkpoint from it, for
    ``--checkpoints`` (the audit package does not open stores itself).
    """
    audit = subparsers.add_parser(
        "audit", help="verify the tamper-evident audit trail (verify), or follow a running server's (tail)"
    )
    audit_sub = audit.add_subparsers(dest="audit_command", metavar="COMMAND", required=True)
    verify = audit_sub.add_parser(
        "verify",
        help="verify the hash chains of an audit spool or of delivered JSON-lines files",
        description=(
            "Check that no audit record was changed, removed, inserted or reordered: every record's hash "
            "must match its content and name the hash of the record before it, per chain (one per gateway "
            "replica). With --checkpoints, a spool must also reach its chain's latest signed checkpoint in "
            "the policy store, so deleting its last records shows. Exit status 0: verified; 1: the first bad "
            "record, or how many records are missing, is printed; 2: unreadable input."
        ),
    )
    source = verify.add_mutually_exclusive_group(required=True)
    source.add_argument("--spool", type=Path, metavar="DIR", help="a gateway's audit spool directory")
    source.add_argument(
        "--file", type=Path, metavar="JSONL", action="append",
        help="a file sink's output (repeat for rotated files, oldest first); identical re-deliveries are skipped",
    )  # fmt: skip
    if load_checkpoint is not None:
        verify.add_argument(
            "--checkpoints", action="store_true",
            help="with --spool: check its tail against the latest signed checkpoint of its chain in the policy "
                 "store (the store of --config / --data-dir, as for serve)",
        )  # fmt: skip
        if store_options is not None:
            store_options(verify)
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.set_defaults(handler=functools.partial(run_verify, load_checkpoint=load_checkpoint))
    return audit


def run_verify(args: argparse.Namespace, load_checkpoint: CheckpointLoader | None = None) -> int:
    checked = getattr(args, "checkpoints", False)
    if checked and args.spool is None:
        print("inferctl: error: --checkpoints needs --spool", file=sys.stderr)
        return EXIT_UNREADABLE
    try:
        if args.spool is None:
            report = verify_files(args.file)
        elif checked and load_checkpoint is not None:
            checkpoint, signer = load_checkpoint(args, spool_chain_id(args.spool))
            report = verify_spool(args.spool, checkpoint=checkpoint, signer=signer)
            if checkpoint is None and not getattr(args, "json", False):
                print(f"no checkpoint of chain {spool_chain_id(args.spool)} in the store: the tail is not checked")
        else:
            report = verify_spool(args.spool)
    except OSError as exc:
        print(f"inferctl: error: cannot read the audit trail: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(json.dumps(report_json(report), indent=2) if getattr(args, "json", False) else format_report(report))
    if args.spool is not None and not checked and report.ok and not getattr(args, "json", False):
        # "OK" covers what is in the spool: records deleted from its end leave a shorter chain that verifies.
        print("(the end of the spool was not checked: records cut from it show only with --checkpoints)")
    return EXIT_OK if report.ok else EXIT_TAMPERED


def report_json(report: VerifyReport) -> dict[str, Any]:
    """``audit verify --json``: the report as data (what ``format_report`` writes as text)."""
    problem = report.problem
    return {
        "ok": report.ok,
        "records": report.records,
        "duplicates": report.duplicates,
        "chains": [dataclasses.asdict(chain) for chain in report.chains],
        "checkpoint": None if report.checkpoint is None else report.checkpoint.describe(),
        "problem": None if problem is None else {"location": problem.location, "message": problem.message},
    }


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
    if report.checkpoint is not None and report.problem is None:
        lines.append(f"tail reaches the signed {report.checkpoint.describe()}")
    if report.problem is not None:
        lines.append(f"TAMPERED: {report.problem}")
    else:
        lines.append(f"OK: {len(report.chains)} chain(s), {report.records} records verified")
    return "\n".join(lines)
