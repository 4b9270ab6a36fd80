"""Audit test helpers: events, loopback HTTP receivers, a real rsyslogd, a test CA.

rsyslogd runs from a generated configuration on free loopback ports with a
work directory under tmp_path, writing every message it receives to a file.
Without ``rsyslogd`` on PATH its tests are skipped, except under CI (``$CI``
set), where that is a failure.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


from inferflux.policy.audit.delivery import Backoff
from inferflux.policy.audit.events import AuditEvent, ContentDigester, Finding, api_event
from inferflux.policy.audit.spool import Spool
from services import service_unavailable

FAST = Backoff(initial=0.01, maximum=0.1)  # retries in tests: quick, still exponential with jitter
# How long a test's Delivery waits on the spool for new records (0.5 s in service). stop()
# waits out the wait in progress, so the default cost every test half a second.
POLL = 0.05
SECRET = b"audit-test-secret-0123456789abcdef"
_counter = itertools.count()


def make_event(tenant: str = "ten_a", decision: str = "allow", **fields: Any) -> AuditEvent:
    """A realistic API-call event; ``request_id`` numbers events in creation order."""
    values: dict[str, Any] = {
        "request_id": f"req-{next(_counter)}",
        "tenant_id": tenant,
        "principal": f"key:{tenant}-k1",
        "key_id": f"{tenant}-k1",
        "route": "POST /v1/chat/completions",
        "model": "smollm2",
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "status": 200 if decision == "allow" else 403,
        "latency_ms": 41.5,
    }
    values.update(fields)
    return api_event(
        decision=decision,
        digester=ContentDigester(SECRET),
        prompt="hello",
        completion="hi there",
        findings=[Finding("pii.email", "pii-1", "input", "redact")],
        **values,
    )


def append_events(spool: Spool, n: int, *, one_by_one: bool = False) -> list[str]:
    """Append ``n`` events, wait until all are durable; their ids in order.

    ``one_by_one`` waits for each before the next, so that each fsync covers one
    event (and small segments rotate every few events).
    """
    events = [make_event() for _ in range(n)]
    if one_by_one:
        assert all(spool.append(e).wait(10) for e in events)
    else:
        receipts = [spool.append(e) for e in events]
        assert all(r.wait(10) for r in receipts)
    return [e.id for e in events]


def sink_from_args(args: list[str]) -> Any:
    """``["http", URL]`` or ``["syslog-tcp", PORT]``: the sink the kill -9 test's child and parent both use."""
    from inferflux.policy.audit.sinks.http import HttpSink
    from inferflux.policy.audit.sinks.syslog import SyslogSink

    kind, where = args
    if kind == "http":
        return HttpSink(where, timeout=2, name="siem")
    return SyslogSink("127.0.0.1", int(where), transport="tcp", hostname="gw-kill", name="siem")


def wait_for(condition: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- HTTP receivers ---------------------------------------------------------------


class HttpReceiver:
    """A real HTTP server on loopback that records each POST; the first ``fail_first`` get ``fail_status``."""

    def __init__(self, port: int | None = None, fail_first: int = 0, fail_status: int = 503) -> None:
        self.port = port or free_port()
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.requests: list[tuple[str, dict[str, str], bytes]] = []  # accepted: path, headers, body
        self.attempts: list[float] = []  # monotonic time of every POST, failed ones included
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HttpReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    receiver.attempts.append(time.monotonic())
                    failing = len(receiver.attempts) <= receiver.fail_first
                    if not failing:
                        receiver.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.fail_status if failing else 200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def records(self) -> list[bytes]:
        """Every record line received, in arrival order (webhook format: a JSON array per POST)."""
        with self._lock:
            bodies = [body for _, _, body in self.requests]
        return [json.dumps(r, separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode()
                for body in bodies for r in json.loads(body)]  # fmt: skip


# -- rsyslogd ---------------------------------------------------------------------


def rsyslogd_path() -> str:
    path = shutil.which("rsyslogd") or next(
        (p for p in ("/usr/sbin/rsyslogd", "/sbin/rsyslogd") if os.access(p, os.X_OK)), None
    )
    if path is None:
        service_unavailable("rsyslogd is not installed (apt-get install -y rsyslog rsyslog-openssl)", "syslog")
    return path


class Rsyslog:
    """A real rsyslogd on loopback: UDP, plain TCP and (with a certificate) TLS inputs, all into one file."""

    def __init__(self, binary: str, work: Path, tls: tuple[Path, Path, Path] | None = None) -> None:
        self.binary = binary
        self.work = work
        self.output = work / "received.log"
        self.udp_port, self.tcp_port = free_port(socket.SOCK_DGRAM), free_port()
        self.tls_port = free_port() if tls else None
        self.config = work / "rsyslog.conf"
        self.config.write_text(self._config(tls))
        self._process: subprocess.Popen[bytes] | None = None

    def _config(self, tls: tuple[Path, Path, Path] | None) -> str:
        spool = self.work / "work"
        spool.mkdir(exist_ok=True)
        lines = [
            f'global(workDirectory="{spool}" maxMessageSize="64k")',
            'module(load="imudp")',
            'module(load="imtcp" maxSessions="50")',
            f'input(type="imudp" address="127.0.0.1" port="{self.udp_port}")',
            f'input(type="imtcp" address="127.0.0.1" port="{self.tcp_port}")',
        ]
        if tls:
            ca, cert, key = tls
            lines.append(
                f'input(type="imtcp" address="127.0.0.1" port="{self.tls_port}" streamDriver.name="ossl" '
                f'streamDriver.mode="1" streamDriver.authMode="anon" streamDriver.CAFile="{ca}" '
                f'streamDriver.CertFile="{cert}" streamDriver.KeyFile="{key}")'
            )
        lines += [
            'template(name="raw" type="string" string="%rawmsg%\\n")',
            f'action(type="omfile" file="{self.output}" template="raw")',
        ]
        return "\n".join(lines) + "\n"

    def start(self) -> Rsyslog:
        self._process = subprocess.Popen(
            [self.binary, "-n", "-f", str(self.config), "-i", str(self.work / "rsyslogd.pid")],
            stdout=subprocess.DEVNULL,
            stderr=(self.work / "rsyslogd.err").open("ab"),
        )
        ports = [p for p in (self.tcp_port, self.tls_port) if p is not None]
        process = self._process
        wait_for(lambda: process.poll() is not None or all(map(_listening, ports)), 20, "rsyslogd to listen")
        if self._process.poll() is not None:
            raise RuntimeError(f"rsyslogd exited: {(self.work / 'rsyslogd.err').read_text()[-2000:]}")
        time.sleep(0.2)  # the UDP input comes up with the TCP ones; give it a moment all the same
        return self

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)
        self._process = None

    def messages(self) -> list[str]:
        try:
            return [line for line in self.output.read_text().splitlines() if line]
        except FileNotFoundError:
            return []

    def records(self) -> list[bytes]:
        """The JSON record of every message received (the MSG part after the structured data)."""
        return [m[m.index("] {") + 2:].encode() for m in self.messages() if "] {" in m]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def make_test_ca(directory: Path, server_name: str = "localhost") -> tuple[Path, Path, Path]:
    """A CA and a server certificate for ``server_name`` and 127.0.0.1; returns (ca, cert, key) files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.now(UTC)

    def certificate(subject: str, key: Any, issuer: x509.Name, signer: Any, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.DNSName(server_name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inferflux test CA")])
    ca_cert = certificate("inferflux test CA", ca_key, ca_name, ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = certificate(server_name, key, ca_name, ca_key, ca=False)
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths[2].chmod(0o600)
    return paths
