"""Structured logs (``log_format: json``): one JSON object a line, for a log pipeline to index.

Each line has ``timestamp`` (UTC, RFC 3339 with milliseconds), ``level``,
``logger`` and ``message``, and, for a line written while serving a request,
that request's ``request_id``, ``tenant`` and, when it is traced
(``gateway.tracing``), ``trace_id`` and ``span_id`` (the request span's, so a
log line leads to its trace); ``exception`` holds a traceback. The request is
found through ``gateway.context.CURRENT``, which the request-context middleware
sets for the task serving it (uvicorn's access line is written in that task too).

Secrets: ``log_redaction.RedactSecrets`` stays on every handler, so the record's
message, arguments and traceback are redacted before this formatter reads them,
and the formatter redacts the finished message and traceback once more: a
credential never reaches the output whichever path a record took (a logger
with its own handler, a record formatted before the filter saw it).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from inferflux.gateway.context import CURRENT
from inferflux.gateway.logs.redaction import redact


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON, with the current request's ids."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.gmtime(record.created)
        line: dict[str, Any] = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", seconds) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        ctx = CURRENT.get()
        if ctx is not None:
            line["request_id"] = ctx.request_id
            if ctx.principal is not None:
                line["tenant"] = str(ctx.principal.tenant_id)
            if ctx.trace is not None:
                line["trace_id"], line["span_id"] = ctx.trace.trace_id, ctx.trace.span_id
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exception"] = redact(record.exc_text)
        if record.stack_info:
            line["stack"] = redact(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure(log_format: str, level: str | int) -> None:
    """The root logger's handler (stderr) in ``log_format`` (``text`` or ``json``), at ``level``."""
    if log_format == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level, handlers=[handler], force=True)
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
