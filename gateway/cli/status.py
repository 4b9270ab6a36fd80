"""``inferctl status``: a running server's health, readiness, version, and per model its queue, sequences and KV use.

Model manifests in error (``registry.path``) are listed after readiness, by file name.

Liveness and readiness come from the probes (``/livez``, ``/readyz``: no
credentials needed); the rest from ``GET /admin/v1/status``, which needs any
key that reads. Without a key the probes are still shown. Exit status 0 when
the server is live and ready, 1 otherwise, so scripts can wait on it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

from inferflux.gateway.cli.client import add_client_options, connect, raise_for_error
from inferflux.gateway.cli.common import EXIT_FAILURE, EXIT_OK


def _probe(client: httpx.Client, path: str) -> dict[str, Any]:
    response = client.get(path)
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):  # not this server's probe: show what came back
        failed = [f"HTTP {response.status_code}: {response.text[:200]}"]
        body = {"reasons": [] if response.status_code == 200 else failed}
    # Ready but degraded (the store unreachable, warm keys served from its snapshot): say so too.
    reasons = body.get("reasons") or body.get("degraded") or []
    probe: dict[str, Any] = {"ok": response.status_code == 200, "reasons": [str(r) for r in reasons]}
    manifests = body.get("manifest_errors")
    if isinstance(manifests, dict) and manifests:  # registry.path's files in error, by name
        probe["manifest_errors"] = {str(file): str(error) for file, error in manifests.items()}
    return probe


def _gather(args: argparse.Namespace) -> dict[str, Any]:
    with connect(args) as client:
        out: dict[str, Any] = {"url": args.url, "live": _probe(client, "/livez"), "ready": _probe(client, "/readyz")}
        if args.api_key:
            response = client.get("/admin/v1/status")
            raise_for_error(response)
            out["status"] = response.json()
    return out


def _percent(model: dict[str, Any]) -> str:
    if "kv_usage" not in model:
        return "-"
    slots = model.get("kv_slot_utilisation")
    filled = "" if slots is None else f", {100 * slots:.0f}% of their slots filled"
    return f"{100 * model['kv_usage']:.1f}% ({model['kv_blocks_used']}/{model['kv_blocks_total']} blocks{filled})"


def _print(report: dict[str, Any]) -> None:
    live, ready = report["live"], report["ready"]
    print(f"server:   {report['url']}")
    print(f"live:     {'yes' if live['ok'] else 'no'}" + "".join(f"\n  - {r}" for r in live["reasons"]))
    print(f"ready:    {'yes' if ready['ok'] else 'no'}" + "".join(f"\n  - {r}" for r in ready["reasons"]))
    for file, error in ready.get("manifest_errors", {}).items():  # registry.path: reported, served as before
        print(f"manifest: {file}: {error}")
    status = report.get("status")
    if status is None:
        print("(no --api-key: version, models and queues need a key that reads)")
        return
    print(f"version:  {status['version']}")
    print(f"queue:    {status['queue_depth']} waiting, {status['running_sequences']} running")
    rows = [("MODEL", "BACKEND", "STATE", "WAITING", "RUNNING", "KV USE")]
    for m in status["models"]:
        state = ("running" if m["running"] else "stopped") + (", default" if m["default"] else "")
        rows.append((m["id"], m["backend"], state, str(m.get("waiting_sequences", "-")),
                     str(m.get("running_sequences", "-")), _percent(m)))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _status(args: argparse.Namespace) -> int:
    report = _gather(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return EXIT_OK if report["live"]["ok"] and report["ready"]["ok"] else EXIT_FAILURE


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``status`` to ``inferctl``'s commands."""
    status = sub.add_parser("status", help="a running server's health, readiness, version, queue and KV use",
                            description=(__doc__ or "").split("\n\n", 1)[1].replace("``", "'"))  # fmt: skip
    add_client_options(status)
    status.add_argument("--json", action="store_true", help="print the probes and the status as JSON")
    status.set_defaults(handler=_status)
