"""The usage queries' buckets: each grain's stored rows and the SQL expression of a row's bucket.

``day`` and ``minute`` are stored grains (``policy.usage.rollup``): a row's bucket is its own.
``hour`` is not stored: it sums the minute rows (so it covers the minute window, the last
``MINUTE_HOURS``), each row's bucket truncated to its hour in SQL, on SQLite and PostgreSQL alike,
so that a query groups, orders and pages by hour in the database.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from inferflux.policy.store.models import UsageRow
from inferflux.policy.store.types import UTCDateTime
from inferflux.policy.usage.rollup import DAY, MINUTE

HOUR: Final = "hour"
GRAINS: Final = (DAY, HOUR, MINUTE)
STORED: Final = {DAY: DAY, HOUR: MINUTE, MINUTE: MINUTE}  # the rows each grain reads
STEP: Final = {DAY: timedelta(days=1), HOUR: timedelta(hours=1), MINUTE: timedelta(minutes=1)}


class HourOf(FunctionElement[datetime]):
    """A UTC datetime column truncated to its hour (a datetime again, through ``UTCDateTime``)."""

    type = UTCDateTime()
    name = "hour_of"
    inherit_cache = True


@compiles(HourOf, "postgresql")
def _hour_of_postgresql(element: HourOf, compiler: SQLCompiler, **kw: Any) -> str:
    # In UTC whatever the session's time zone: date_trunc on a timestamptz truncates in the session's zone.
    column = compiler.process(element.clauses, **kw)
    return f"(date_trunc('hour', {column} AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')"


@compiles(HourOf)
def _hour_of_sqlite(element: HourOf, compiler: SQLCompiler, **kw: Any) -> str:
    # SQLite keeps the UTC datetime as text; strftime's answer is text UTCDateTime reads back.
    return f"strftime('%Y-%m-%d %H:00:00', {compiler.process(element.clauses, **kw)})"


def bucket_column(grain: str) -> ColumnElement[datetime]:
    """The bucket a row of ``STORED[grain]`` adds to, as SQL."""
    return HourOf(UsageRow.bucket) if grain == HOUR else UsageRow.bucket  # type: ignore[return-value]
