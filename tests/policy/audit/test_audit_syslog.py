"""Syslog RFC 5424 over UDP, TCP (octet counting) and TLS, end to end into a real rsyslogd on loopback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from audit_support import FAST, POLL, Rsyslog, append_events, make_event, wait_for

from inferflux.policy.audit.chain import verify_lines
from inferflux.policy.audit.delivery import Delivery
from inferflux.policy.audit.sinks.syslog import SyslogSink, format_message
from inferflux.policy.audit.spool import Cursor, Spool, SpooledRecord

# <PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID [SD] MSG
RFC5424 = re.compile(
    r'^<(?P<pri>\d{1,3})>1 (?P<ts>\S+) (?P<host>\S+) inferflux (?P<procid>\d+) (?P<msgid>api|admin) '
    r'\[audit@32473 id="(?P<id>aev_[a-z2-7]{20})" chain="(?P<chain>[^"]+)" seq="(?P<seq>\d+)" '
    r'tenant="(?P<tenant>[^"]+)" decision="(?P<decision>\w+)"\] (?P<msg>\{.*\})$'
)


def sink_for(rsyslog: Rsyslog, transport: str, tmp_path: Path) -> SyslogSink:
    port = {"udp": rsyslog.udp_port, "tcp": rsyslog.tcp_port, "tls": rsyslog.tls_port}[transport]
    assert port is not None
    return SyslogSink("127.0.0.1", port, transport=transport, ca_file=tmp_path / "tls" / "ca.pem",
                      server_name="localhost", hostname="gw-1")  # fmt: skip


@pytest.mark.parametrize("transport", ["udp", "tcp", "tls"])
def test_events_arrive_in_rsyslog(rsyslog: Rsyslog, spool: Spool, tmp_path: Path, transport: str) -> None:
    sink = sink_for(rsyslog, transport, tmp_path)
    delivery = Delivery(spool, sink, backoff=FAST, poll_seconds=POLL, batch_size=7).start()
    ids = append_events(spool, 30)
    assert delivery.wait_caught_up(15)
    wait_for(lambda: len(rsyslog.messages()) >= 30, what=f"30 messages over {transport}")
    delivery.stop()
    messages = rsyslog.messages()
    parsed = [RFC5424.match(m) for m in messages]
    assert all(parsed), [m for m, p in zip(messages, parsed, strict=True) if not p][:1]
    assert [p["id"] for p in parsed if p] == ids  # one connection, in order (and UDP on loopback)
    first = parsed[0]
    assert first is not None
    assert int(first["pri"]) == 13 * 8 + 6 and first["host"] == "gw-1" and first["chain"] == "gw-test"
    assert json.loads(first["msg"])["event"]["id"] == first["id"]
    assert verify_lines((str(i), r) for i, r in enumerate(rsyslog.records())).records == 30


def test_tls_refuses_a_receiver_it_cannot_verify(rsyslog: Rsyslog, spool: Spool, tmp_path: Path) -> None:
    assert rsyslog.tls_port is not None
    sink = SyslogSink("127.0.0.1", rsyslog.tls_port, transport="tls", server_name="localhost")  # system CAs only
    delivery = Delivery(spool, sink, backoff=FAST, poll_seconds=POLL).start()
    append_events(spool, 3)
    wait_for(lambda: delivery.stats.failures >= 2, what="verification failures")
    delivery.stop()
    assert "CERTIFICATE_VERIFY_FAILED" in (delivery.stats.last_error or "")
    assert rsyslog.messages() == []


def test_tcp_delivery_resumes_after_the_receiver_restarts(rsyslog: Rsyslog, spool: Spool, tmp_path: Path) -> None:
    sink = sink_for(rsyslog, "tcp", tmp_path)
    delivery = Delivery(spool, sink, backoff=FAST, poll_seconds=POLL).start()
    first = append_events(spool, 5)
    wait_for(lambda: len(rsyslog.messages()) >= 5, what="the first messages")
    rsyslog.stop()
    second = append_events(spool, 5)
    wait_for(lambda: delivery.stats.failures >= 2, what="failures while rsyslog is down")
    rsyslog.start()
    assert delivery.wait_caught_up(20)
    wait_for(lambda: {*first, *second} <= {json.loads(r)["event"]["id"] for r in rsyslog.records()},
             what="every event after the restart")  # fmt: skip
    delivery.stop()


def test_message_format_escapes_structured_data() -> None:
    event = make_event(tenant='te"n]\\')
    line = json.dumps({"chain": "c", "seq": 1, "event": event.to_json()}).encode()
    record = SpooledRecord(line, json.loads(line), Cursor(1, 0))
    message = format_message(record, hostname="host with spaces", procid="7")
    assert b' tenant="te\\"n\\]\\\\" ' in message
    assert message.startswith(b"<110>1 ") and b" hostwithspaces inferflux 7 api [" in message
    assert message.endswith(line)


@pytest.mark.parametrize(
    "kwargs", [{"transport": "smtp"}, {"port": 0}, {"port": 70000}, {"facility": 24}]
)
def test_bad_syslog_settings(kwargs: dict[str, object]) -> None:
    values: dict[str, object] = {"host": "127.0.0.1", "port": 514, "transport": "tcp", **kwargs}
    with pytest.raises(ValueError):
        SyslogSink(**values)  # type: ignore[arg-type]

