"""HTTP batch sinks: a generic JSON webhook and Splunk's HTTP Event Collector.

A batch is one POST; any answer but 2xx (or no answer) fails the batch and the
delivery loop retries it with back-off, so the receiver's 2xx is the
acknowledgement. Records are embedded byte for byte as they were spooled, so
the receiver can verify the chain itself.

* ``format="json"``: ``[record, record, ...]`` as ``application/json``;
  ``Authorization: Bearer <token>`` when a token is given.
* ``format="splunk_hec"``: to ``<url>/services/collector/event`` with
  ``Authorization: Splunk <token>``, a body of newline-separated
  ``{"time": ..., "host": <chain>, "source": ..., "sourcetype": ..., "event": record}``.

The token is a secret: it is kept out of ``repr``, errors and logs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Final

import httpx

from inferflux.policy.audit.errors import SinkError
from inferflux.policy.audit.spool import SpooledRecord

FORMATS: Final = ("json", "splunk_hec")
HEC_PATH: Final = "/services/collector/event"


class HttpSink:
    def __init__(
        self,
        url: str,
        *,
        format: str = "json",
        token: str | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        timeout: float = 10.0,
        headers: Mapping[str, str] | None = None,
        source: str = "inferflux",
        sourcetype: str = "inferflux:audit",
        name: str | None = None,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"HTTP sink format must be one of {', '.join(FORMATS)}")
        if not url.startswith(("http://", "https://")):
            raise ValueError("HTTP sink url must start with http:// or https://")
        if format == "splunk_hec" and not token:
            raise ValueError("a Splunk HEC sink needs a token")
        self.name = name or ("splunk-hec" if format == "splunk_hec" else "webhook")
        self.format = format
        self.url = url.rstrip("/") + HEC_PATH if format == "splunk_hec" and not url.endswith(HEC_PATH) else url
        self._source, self._sourcetype = source, sourcetype
        auth = {}
        if token:
            auth["authorization"] = f"Splunk {token}" if format == "splunk_hec" else f"Bearer {token}"
        self._client = httpx.Client(
            timeout=timeout,
            verify=True if ca_file is None else os.fspath(ca_file),
            headers={**(headers or {}), **auth, "content-type": "application/json"},
            follow_redirects=False,  # a redirect would carry the token somewhere unconfigured
        )

    def __repr__(self) -> str:
        return f"HttpSink(name={self.name!r}, url={self.url!r}, format={self.format!r})"

    def body(self, records: Sequence[SpooledRecord]) -> bytes:
        if self.format == "json":
            return b"[" + b",".join(r.line for r in records) + b"]"
        return b"\n".join(self._hec_event(r) for r in records)

    def _hec_event(self, record: SpooledRecord) -> bytes:
        meta = {"host": record.chain or "-", "source": self._source, "sourcetype": self._sourcetype,
                "time": _epoch(record.event.get("at"))}  # fmt: skip
        head = json.dumps(meta, separators=(",", ":")).encode()
        return head[:-1] + b',"event":' + record.line + b"}"

    def send(self, records: Sequence[SpooledRecord]) -> None:
        try:
            response = self._client.post(self.url, content=self.body(records))
        except httpx.HTTPError as exc:
            raise SinkError(f"POST {self.url}: {type(exc).__name__}: {exc}") from None
        if not response.is_success:
            raise SinkError(f"POST {self.url}: HTTP {response.status_code}")

    def close(self) -> None:
        self._client.close()


def _epoch(at: object) -> float | None:
    try:
        return round(datetime.fromisoformat(str(at).replace("Z", "+00:00")).timestamp(), 6)
    except ValueError:
        return None
