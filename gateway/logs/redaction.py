"""Credentials never reach a log line: a filter that redacts them on every record.

uvicorn's access log writes the whole request target, so a client that puts
its key in the query string (``?api_key=...``, refused by the gateway, which
reads credentials from headers only) would otherwise have the key written to
disk. ``RedactSecrets`` rewrites what a record will print before any handler
formats it:

* the value of every query parameter whose name says it is a credential
  (``api_key``, ``key``, ``access_token``, ``token``, ``client_secret``,
  ``password``, ``signature``, ... : any name containing key, token, secret,
  pass, auth, sig, credential, session or cookie);
* credentials by their shape, wherever they appear: our API keys (the public
  prefix is kept, so an operator can still tell which key it was), JWTs, and
  ``Bearer`` values;
* the values of credential headers when something prints headers
  (``authorization``, ``cookie``, ``x-api-key``, ...).

``install()`` puts the filter on the handlers present on the root and uvicorn
loggers, and on the loggers that emit requests' details themselves (uvicorn's
access and error loggers, whose own handlers ``logging.config.dictConfig``
replaces but whose logger filters it keeps); ``log_config()`` is uvicorn's
logging configuration with the filter on each of its handlers, for ``serve``.
Nothing in the gateway logs request bodies.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any, Final

REDACTED: Final = "[REDACTED]"

_SENSITIVE_NAME = r"[^\s=&?;#\"']*(?:key|token|secret|pass|pwd|auth|sig|credential|session|cookie)[^\s=&?;#\"']*"
# A sensitive query parameter's value, up to the next separator.
_QUERY_PARAM = re.compile(rf"(?i)([?&;]{_SENSITIVE_NAME}=)[^&;#\s\"']*")
# Our API keys: ifx_<public prefix>_<secret>; the prefix is not a secret.
_API_KEY = re.compile(r"(ifx_[a-z2-7]{12}_)[0-9A-Za-z]{43}")
# A JWT (or any JWS): its header is JSON, so base64url "eyJ", then two more segments.
_JWT = re.compile(r"eyJ[A-Za-z0-9_-]*\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
_BEARER = re.compile(r"(?i)(\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]+")
# A credential header printed as "name: value", "name=value", {'name': 'value'} or (b'name', b'value').
_HEADER = re.compile(
    r"(?i)((?:proxy-)?authorization|(?:set-)?cookie|x-api-key|api-key|x-auth-token)"
    r"([\"']?\s*[:=,]\s*b?[\"']?)([^\"'\r\n]*)"
)

_UVICORN_LOGGERS: Final = ("uvicorn", "uvicorn.error", "uvicorn.access")


def redact(text: str) -> str:
    """``text`` with every credential it holds replaced by ``[REDACTED]``."""
    if not text:
        return text
    text = _HEADER.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    text = _QUERY_PARAM.sub(lambda m: m.group(1) + REDACTED, text)
    text = _API_KEY.sub(lambda m: m.group(1) + REDACTED, text)
    text = _BEARER.sub(lambda m: m.group(1) + REDACTED, text)
    return _JWT.sub(REDACTED, text)


def _redact_value(value: Any) -> Any:
    # Only text and bytes can hold a credential's characters; numbers stay numbers for %d.
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, bytes):
        return redact(value.decode("latin-1")).encode("latin-1")
    return value


class RedactSecrets(logging.Filter):
    """Rewrites a record's message, arguments and traceback text so no credential is printed.

    The arguments are redacted one by one rather than the message formatted
    once, because formatters read them (uvicorn's access formatter unpacks the
    client, method, path, version and status).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_inferflux_redacted", False):
            return True  # one record can pass several filtered handlers
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        elif not isinstance(record.msg, int | float):
            record.msg = redact(str(record.msg))
        if isinstance(record.args, tuple):
            record.args = tuple(_redact_value(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redact_value(v) for k, v in record.args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        record._inferflux_redacted = True
        return True


_FILTER: Final = RedactSecrets()


def _add(target: logging.Filterer) -> None:
    if not any(isinstance(f, RedactSecrets) for f in target.filters):
        target.addFilter(_FILTER)


def install() -> None:
    """Redact on every handler the root and uvicorn loggers have now, and on uvicorn's emitting loggers.

    Idempotent; the app factory and ``serve`` both call it, before and after
    configuring logging.
    """
    for name in ("", *_UVICORN_LOGGERS):
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            _add(handler)
    for name in _UVICORN_LOGGERS:
        _add(logging.getLogger(name))


def log_config(log_format: str = "text") -> dict[str, Any]:
    """uvicorn's default logging configuration, every handler filtered through ``RedactSecrets``;
    with ``log_format`` ``json``, every line one JSON object (``gateway.logs.structured``)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_secrets"] = {"()": f"{__name__}.RedactSecrets"}
    if log_format == "json":
        config["formatters"] = {name: {"()": "inferflux.gateway.logs.structured.JsonFormatter"} for name in config["formatters"]}
    for handler in config.get("handlers", {}).values():
        handler["filters"] = [*handler.get("filters", []), "redact_secrets"]
    return config
