"""Rows to records: one mapper for every record type, built from the record's fields.

A record (``policy.store.records``) is a frozen snapshot of a row, and most of
its fields are the row's attributes of the same name, copied as they are. A
``RecordMapper`` names the exceptions only: a JSON list that becomes a tuple,
a JSON object copied into a dict of the record's own. Secret columns are found
from the model (``types.secret_columns``) and opened with the store's key
ring, so a new secret column cannot reach a record still sealed.

The mapper checks its record against the model when it is made (at import),
so a field added to a record but not to its table fails at once, not at the
first read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sqlalchemy import inspect

from inferflux.policy.store.keys import KeyManager
from inferflux.policy.store.models import Base
from inferflux.policy.store.types import secret_columns

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

R = TypeVar("R", bound="DataclassInstance")
Convert = Callable[[Any], Any]


def optional(convert: Convert) -> Convert:
    """``convert`` for a nullable column: None stays None."""
    return lambda value: None if value is None else convert(value)


class RecordMapper(Generic[R]):
    """Makes ``record``s of ``model`` rows; ``convert`` names the fields that are not copied as they are."""

    def __init__(self, model: type[Base], record: type[R], **convert: Convert) -> None:
        names = [field.name for field in dataclasses.fields(record)]
        columns = set(inspect(model).column_attrs.keys())
        unknown = [name for name in names if name not in columns] + [name for name in convert if name not in names]
        if unknown:
            raise TypeError(f"{record.__name__} and {model.__name__} disagree on {', '.join(unknown)}")
        secrets = set(secret_columns(model))
        self.model = model
        self._record = record
        self._plain = tuple((name, convert.get(name)) for name in names if name not in secrets)
        self._secret = tuple(name for name in names if name in secrets)

    def build(self, row: Base, keys: KeyManager) -> R:
        """The record of ``row``, its secrets opened with ``keys``."""
        values: dict[str, Any] = {}
        for name, convert in self._plain:
            value = getattr(row, name)
            values[name] = value if convert is None else convert(value)
        for name in self._secret:
            values[name] = keys.open(row, name)
        return self._record(**values)
