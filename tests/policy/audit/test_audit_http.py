"""HTTP batch sinks against real loopback servers: webhook and Splunk HEC, retry with back-off, outages."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import pytest
from audit_support import FAST, POLL, HttpReceiver, append_events, wait_for

from inferflux.policy.audit.chain import verify_lines
from inferflux.policy.audit.delivery import Backoff, Delivery
from inferflux.policy.audit.sinks.http import HttpSink
from inferflux.policy.audit.spool import Spool

TOKEN = "hec-token-7f3a9c1e5b"


def test_webhook_retries_with_backoff_until_accepted(
    spool: Spool, http_receiver: Callable[..., HttpReceiver], caplog: pytest.LogCaptureFixture
) -> None:
    receiver = http_receiver(fail_first=4).start()
    sink = HttpSink(receiver.url + "/hook", token=TOKEN)
    delivery = Delivery(spool, sink, backoff=Backoff(initial=0.05, maximum=1.0), poll_seconds=POLL).start()
    with caplog.at_level(logging.WARNING, "inferflux.policy.audit"):
        ids = append_events(spool, 25)
        assert delivery.wait_caught_up(20)
    delivery.stop()
    assert len(receiver.attempts) >= 5 and delivery.stats.failures >= 4
    assert "HTTP 503" in (delivery.stats.last_error or "")
    received = [json.loads(r)["event"]["id"] for r in receiver.records()]
    assert set(ids) <= set(received)
    path, headers, _ = receiver.requests[0]
    assert path == "/hook" and headers["authorization"] == f"Bearer {TOKEN}"
    assert headers["content-type"] == "application/json"
    assert verify_lines(((str(i), r) for i, r in enumerate(receiver.records())), allow_duplicates=True).ok
    assert TOKEN not in caplog.text and TOKEN not in repr(sink)
    gaps = [b - a for a, b in zip(receiver.attempts, receiver.attempts[1:], strict=False)][:4]
    assert sum(gaps) < 10  # backed off, but within the configured maximum


def test_splunk_hec_format(spool: Spool, http_receiver: Callable[..., HttpReceiver]) -> None:
    receiver = http_receiver().start()
    sink = HttpSink(receiver.url, format="splunk_hec", token=TOKEN)
    delivery = Delivery(spool, sink, backoff=FAST, poll_seconds=POLL).start()
    ids = append_events(spool, 5)
    assert delivery.wait_caught_up(15)
    delivery.stop()
    path, headers, body = receiver.requests[0]
    assert path == "/services/collector/event"
    assert headers["authorization"] == f"Splunk {TOKEN}"
    events = [json.loads(line) for part in [r[2] for r in receiver.requests] for line in part.split(b"\n")]
    assert [e["event"]["event"]["id"] for e in events] == ids
    first = events[0]
    assert first["host"] == spool.chain_id and first["sourcetype"] == "inferflux:audit"
    assert isinstance(first["time"], float) and first["source"] == "inferflux"
    assert b"\n" in body or len(ids) == 1  # newline-separated event objects, not an array


def test_a_receiver_that_is_down_then_comes_up(spool: Spool, http_receiver: Callable[..., HttpReceiver]) -> None:
    receiver = http_receiver()  # not started: connection refused
    sink = HttpSink(receiver.url, timeout=2)
    delivery = Delivery(spool, sink, backoff=FAST, poll_seconds=POLL).start()
    ids = append_events(spool, 15)
    wait_for(lambda: delivery.stats.failures >= 3, what="failed attempts while the receiver is down")
    assert not delivery.caught_up()
    assert "ConnectError" in (delivery.stats.last_error or "")
    receiver.start()
    assert delivery.wait_caught_up(15)
    delivery.stop()
    assert [json.loads(r)["event"]["id"] for r in receiver.records()] == ids


@pytest.mark.slow  # an outage long enough for the back-off to reach its cap, in real time
@pytest.mark.serial  # the backlog's arrival is timed against the cap
def test_a_receiver_back_after_a_long_outage_gets_its_backlog_within_five_seconds(
    spool: Spool, http_receiver: Callable[..., HttpReceiver]
) -> None:
    receiver = http_receiver()  # not started: connection refused
    delivery = Delivery(spool, HttpSink(receiver.url, timeout=2), poll_seconds=POLL).start()  # the default back-off
    ids = append_events(spool, 40)
    # Eight failed attempts: an uncapped back-off would now wait up to 0.2·2⁸ s before the next.
    wait_for(lambda: delivery.stats.failures >= 8, timeout=120, what="eight failed attempts")
    receiver.start()
    back = time.monotonic()
    assert delivery.wait_caught_up(5.0), f"backlog not delivered {time.monotonic() - back:.1f} s after the return"
    delivery.stop()
    assert [json.loads(r)["event"]["id"] for r in receiver.records()] == ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": "ftp://x"}, "http:// or https://"),
        ({"url": "http://x", "format": "xml"}, "format"),
        ({"url": "http://x", "format": "splunk_hec"}, "token"),
    ],
)
def test_bad_http_sink_settings(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HttpSink(**kwargs)
