"""Syslog sink: RFC 5424 messages over UDP, TCP (RFC 6587 octet counting) or TLS (RFC 5425).

Each record becomes one message whose MSG is the spooled JSON line, with the
event id, chain and seq repeated as structured data so a SIEM can index and
de-duplicate without parsing the JSON::

    <110>1 2026-01-01T00:00:00.000000Z gw-1 inferflux 4242 api [audit@32473 id="aev_..."
        chain="gw-1-ab12" seq="17" tenant="ten_..." decision="allow"] {"chain":...}

(one line; broken here to fit).

What "delivered" means differs by transport: UDP has no acknowledgement at
all (a datagram sent is a datagram delivered, which is why it is not the
default); TCP and TLS count a batch delivered once the kernel accepted it, so
a receiver that dies with unread data in its socket buffer can lose that
batch. For audit that must survive receiver crashes use TLS or TCP to a relay
with a disk queue, or the HTTP sink, whose receiver acknowledges each batch.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
from collections.abc import Sequence
from typing import Final

from inferflux.policy.audit.errors import SinkError
from inferflux.policy.audit.spool import SpooledRecord

TRANSPORTS: Final = ("udp", "tcp", "tls")
FACILITY_AUDIT: Final = 13  # "log audit"
_SEVERITY = {"allow": 6, "deny": 4, "error": 3}  # informational, warning, error
_UDP_MAX: Final = 65_000


def format_message(
    record: SpooledRecord, *, hostname: str, app_name: str = "inferflux", facility: int = FACILITY_AUDIT,
    sd_id: str = "audit@32473", procid: str = "-",
) -> bytes:  # fmt: skip
    """One record as an RFC 5424 message (no framing)."""
    event = record.event
    pri = facility * 8 + _SEVERITY.get(str(event.get("decision")), 5)
    timestamp = str(event.get("at") or "-")
    msgid = _token(str(event.get("kind") or "-"), 32)
    params = {
        "id": event.get("id"),
        "chain": record.chain,
        "seq": record.seq,
        "tenant": event.get("tenant_id"),
        "decision": event.get("decision"),
    }
    sd = " ".join(f'{k}="{_sd_escape(str(v))}"' for k, v in params.items() if v is not None)
    header = f"<{pri}>1 {timestamp} {_token(hostname, 255)} {_token(app_name, 48)} {_token(procid, 128)} {msgid}"
    return f"{header} [{sd_id} {sd}] ".encode() + record.line


def _token(value: str, limit: int) -> str:
    """A header field: printable US-ASCII without spaces, or the nil value."""
    cleaned = "".join(c for c in value if 33 <= ord(c) <= 126)[:limit]
    return cleaned or "-"


def _sd_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("]", "\\]")


class SyslogSink:
    """Sends records to a syslog receiver; ``transport`` is "udp", "tcp" or "tls"."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        transport: str = "tls",
        ca_file: str | os.PathLike[str] | None = None,
        server_name: str | None = None,
        client_cert: str | os.PathLike[str] | None = None,
        client_key: str | os.PathLike[str] | None = None,
        hostname: str | None = None,
        app_name: str = "inferflux",
        facility: int = FACILITY_AUDIT,
        timeout: float = 5.0,
        name: str | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"syslog transport must be one of {', '.join(TRANSPORTS)}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError("syslog port must be 1-65535")
        if not isinstance(facility, int) or not 0 <= facility <= 23:
            raise ValueError("syslog facility must be 0-23")
        self.name = name or f"syslog-{transport}"
        self.host, self.port, self.transport = host, port, transport
        self._timeout = timeout
        self._hostname = hostname or socket.gethostname()
        self._app_name = app_name
        self._facility = facility
        self._procid = str(os.getpid())
        self._tls: ssl.SSLContext | None = None
        self._server_name = server_name or host
        if transport == "tls":
            # Verification on, always: a CA file (or the system store) and the receiver's name.
            self._tls = ssl.create_default_context(cafile=None if ca_file is None else os.fspath(ca_file))
            self._tls.minimum_version = ssl.TLSVersion.TLSv1_2
            if client_cert is not None:
                self._tls.load_cert_chain(os.fspath(client_cert), None if client_key is None else os.fspath(client_key))
        self._sock: socket.socket | None = None

    def send(self, records: Sequence[SpooledRecord]) -> None:
        messages = [
            format_message(r, hostname=self._hostname, app_name=self._app_name, facility=self._facility,
                           procid=self._procid)
            for r in records
        ]  # fmt: skip
        try:
            if self.transport == "udp":
                self._send_datagrams(messages)
            else:
                self._send_stream(b"".join(b"%d %s" % (len(m), m) for m in messages))
        except (OSError, ssl.SSLError) as exc:
            self.close()
            raise SinkError(f"syslog {self.transport} {self.host}:{self.port}: {exc}") from None

    def _send_datagrams(self, messages: list[bytes]) -> None:
        if self._sock is None:
            self._sock = socket.socket(_family(self.host), socket.SOCK_DGRAM)
            self._sock.connect((self.host, self.port))
        for message in messages:
            # A datagram cannot be larger; the structured data (id, chain, seq) survives the cut.
            self._sock.send(message[:_UDP_MAX])

    def _send_stream(self, data: bytes) -> None:
        if self._sock is not None and _peer_closed(self._sock):
            self.close()  # the receiver went away since the last batch: do not write into a dead socket
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self._timeout)
            if self._tls is not None:
                try:
                    sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
                except BaseException:
                    sock.close()
                    raise
            self._sock = sock
        self._sock.sendall(data)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the receiver closed its end since the last batch.

    A syslog receiver never sends, so a readable socket means end of stream,
    or under TLS 1.3 a session ticket, which reading one byte consumes.
    """
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        timeout = sock.gettimeout()
        sock.setblocking(False)
        try:
            return sock.recv(1) == b""
        finally:
            sock.settimeout(timeout)
    except (ssl.SSLWantReadError, BlockingIOError):
        return False
    except (OSError, ValueError):
        return True


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
