"""A pytest plugin: no secret the suite creates may appear in a log record (issue 18).

It records every API key the code generates (``policy.authn.apikeys.generate_key``:
bootstrap, admin-created and rotated keys, and the tests' own), every token the
tests' identity provider mints or hand-builds (``idp``), and whatever a test
hands to ``remember`` (client secrets, passphrases). A handler on the root
logger, installed for the session, looks at every record as the code made it
(before ``gateway.logs.redaction.RedactSecrets``, which only a configured
handler applies) and notes each one holding a recorded secret; the run fails
at the end if any did, naming the test and the logger; the test itself fails in its
teardown (under pytest-xdist that is how a worker's finding reaches the run).

Cheap: API keys and tokens are found by their shape with one regular
expression per record and then looked up in a set; only the few secrets
without a shape are searched for as substrings. Records of loggers that do not
propagate to the root (uvicorn's own) and below the root's level are not
seen; ``tests/gateway/test_gateway_log_secrets.py`` greps a served gateway's
whole output, at debug level, for those.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from inferflux.gateway.logs.redaction import RedactSecrets

_SHAPED = re.compile(r"ifx_[a-z2-7]{12}_[0-9A-Za-z]{43}|eyJ[A-Za-z0-9_-]*\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
_shaped: set[str] = set()  # keys and tokens, found by shape
_plain: set[str] = set()  # other secrets, found by substring
_leaks: list[str] = []
_current = "(outside a test)"
_seen = 0  # len(_leaks) when the current test began


def remember(secret: str) -> str:
    """Have the session fail if ``secret`` ever shows in a log record; returns it."""
    (_shaped if _SHAPED.fullmatch(secret) else _plain).add(secret)
    return secret


def _record_keys() -> None:
    import inferflux.policy.authn.apikeys as apikeys

    original = apikeys.generate_key

    def generate_key() -> Any:
        key = original()
        _shaped.add(key.token)
        return key

    apikeys.generate_key = generate_key  # type: ignore[assignment]
    api_keys = sys.modules.get("inferflux.policy.store.repos.api_keys")  # imported already: its own name too
    if api_keys is not None:
        api_keys.generate_key = generate_key  # type: ignore[attr-defined]


def _record_tokens() -> None:
    import idp

    def recording(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> str:
            return remember(fn(*args, **kwargs))

        return wrapper

    idp.LoopbackIdP.mint = recording(idp.LoopbackIdP.mint)  # type: ignore[method-assign]
    idp.hand_built_token = recording(idp.hand_built_token)  # hmac_token builds through it too


class _Watch(logging.Handler):
    """Sees records as the code made them, unredacted: a secret in a record would reach any handler an
    operator adds without ``RedactSecrets`` (a log shipper configured by hand), so it counts as a leak."""

    def addFilter(self, filter: Any) -> None:  # noqa: A002 - logging's own name
        if not isinstance(filter, RedactSecrets):  # gateway.logs.redaction.install() adds it to root handlers
            super().addFilter(filter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # a record that cannot be formatted prints nothing either
            return
        found = [m.group(0) for m in _SHAPED.finditer(text) if m.group(0) in _shaped]
        found += [s for s in _plain if s in text]
        if found:
            _leaks.append(f"{_current}: logger {record.name!r} printed {len(found)} secret(s), "
                          f"e.g. {found[0][:12]}...")  # fmt: skip


_handler = _Watch(level=logging.NOTSET)


def pytest_configure(config: pytest.Config) -> None:
    _record_keys()
    _record_tokens()
    logging.getLogger().addHandler(_handler)


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current, _seen
    _current = item.nodeid
    _seen = len(_leaks)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A test whose set-up, run or tear-down logged a secret fails in its teardown report: reports are what
    pytest-xdist's workers send back, so the run fails there too (a worker's session status is not)."""
    report: pytest.TestReport = yield
    if call.when == "teardown" and len(_leaks) > _seen and report.passed:
        report.outcome = "failed"
        report.longrepr = "secrets in log records:\n" + "\n".join(_leaks[_seen:][:10])
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    logging.getLogger().removeHandler(_handler)
    if _leaks and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _leaks:
        terminalreporter.section("secrets in log records", red=True)
        for leak in _leaks[:50]:
            terminalreporter.write_line(leak)
