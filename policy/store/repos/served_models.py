"""Served models: the platform's registry of models loaded at every start (no tenant owns one).

A model's name and aliases share one namespace across all models, and at most
one model is the default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from inferflux.policy.errors import Conflict, NotFound, ValidationFailed
from inferflux.policy.store import validate
from inferflux.policy.store.models import ServedModelRow
from inferflux.policy.store.records import ServedModelRecord
from inferflux.policy.store.repos.base import UNSET, Repository, Unset, flush_or_conflict, get_row
from inferflux.policy.store.repos.mapper import RecordMapper
from inferflux.policy.store.types import new_id

SERVED_MODEL = RecordMapper(ServedModelRow, ServedModelRecord, aliases=tuple)


class ServedModelRepository(Repository):
    def create_served_model(
        self,
        name: str,
        path: str,
        backend: str = "cpu",
        dtype: str = "auto",
        aliases: Sequence[str] = (),
        is_default: bool = False,
        upstream: Mapping[str, Any] | None = None,
        embedding: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        passes: Mapping[str, Any] | None = None,
    ) -> ServedModelRecord:
        """Register a model: its weights' ``path`` here, or (a remote backend's) its ``upstream`` and path "".

        ``embedding``: how a local model answers /v1/embeddings, as the gateway checked it (kept as given);
        ``passes``: its load passes, likewise.
        """
        validate.text(name, "name", 200)
        alias_list = validate.strings(aliases, "aliases")
        now = self._now()
        row = ServedModelRow(
            id=new_id("mdl"),
            name=name,
            path=validate.text(path, "path", 4096, empty=upstream is not None),
            backend=validate.text(backend, "backend", 64),
            dtype=validate.text(dtype, "dtype", 16),
            aliases=alias_list,
            is_default=validate.boolean(is_default, "is_default"),
            created_at=now,
            updated_at=now,
            upstream=None if upstream is None else _section(upstream, "upstream"),
            embedding=None if embedding is None else _section(embedding, "embedding"),
            deterministic=validate.boolean(deterministic, "deterministic"),
            passes=None if passes is None else _section(passes, "passes"),
        )
        with self._write() as session:
            _check_model_names_free(session, [name, *alias_list], exclude_id=None)
            if row.is_default:
                session.execute(update(ServedModelRow).values(is_default=False))
            session.add(row)
            flush_or_conflict(session, f"A model named '{name}' is already registered")
            return self._record(SERVED_MODEL, row)

    def get_served_model(self, model_id: str) -> ServedModelRecord:
        with self._read() as session:
            return self._record(SERVED_MODEL, get_row(session, ServedModelRow, model_id, "model"))

    def get_served_model_by_name(self, name: str) -> ServedModelRecord:
        with self._read() as session:
            return self._record(SERVED_MODEL, _model_named(session, name))

    def list_served_models(self) -> list[ServedModelRecord]:
        """Every registered model, oldest first: the registry is small and read whole at start-up."""
        with self._read() as session:
            rows = session.scalars(select(ServedModelRow).order_by(ServedModelRow.created_at, ServedModelRow.id)).all()
            return [self._record(SERVED_MODEL, row) for row in rows]

    def update_served_model(
        self,
        model_id: str,
        *,
        path: str | Unset = UNSET,
        backend: str | Unset = UNSET,
        dtype: str | Unset = UNSET,
        aliases: Sequence[str] | Unset = UNSET,
        is_default: bool | Unset = UNSET,
    ) -> ServedModelRecord:
        with self._write() as session:
            row = get_row(session, ServedModelRow, model_id, "model")
            if not isinstance(path, Unset):
                row.path = validate.text(path, "path", 4096)
            if not isinstance(backend, Unset):
                row.backend = validate.text(backend, "backend", 64)
            if not isinstance(dtype, Unset):
                row.dtype = validate.text(dtype, "dtype", 16)
            if not isinstance(aliases, Unset):
                row.aliases = validate.strings(aliases, "aliases")
                _check_model_names_free(session, [row.name, *row.aliases], exclude_id=row.id)
            if not isinstance(is_default, Unset):
                if validate.boolean(is_default, "is_default"):
                    _clear_default(session, except_id=row.id)
                row.is_default = is_default
            row.updated_at = self._now()
            return self._record(SERVED_MODEL, row)

    def set_default_served_model(self, name: str) -> ServedModelRecord:
        """Make ``name`` the one default model (the others lose the mark)."""
        with self._write() as session:
            row = _model_named(session, name)
            _clear_default(session, except_id=row.id)
            row.is_default = True
            row.updated_at = self._now()
            return self._record(SERVED_MODEL, row)

    def delete_served_model(self, model_id: str) -> None:
        with self._write() as session:
            session.delete(get_row(session, ServedModelRow, model_id, "model"))


def _model_named(session: Session, name: str) -> ServedModelRow:
    row = session.scalar(select(ServedModelRow).where(ServedModelRow.name == name))
    if row is None:
        raise NotFound(f"No model '{name}'")
    return row


def _clear_default(session: Session, *, except_id: str) -> None:
    session.execute(update(ServedModelRow).where(ServedModelRow.id != except_id).values(is_default=False))


def _check_model_names_free(session: Session, names: Sequence[str], *, exclude_id: str | None) -> None:
    wanted = set(names)
    if len(wanted) != len(names):
        raise ValidationFailed("a model's name and aliases must differ from each other", param="aliases")
    query = select(ServedModelRow)
    if exclude_id is not None:
        query = query.where(ServedModelRow.id != exclude_id)
    for other in session.scalars(query):
        taken = wanted & {other.name, *other.aliases}
        if taken:
            raise Conflict(f"The model name or alias '{sorted(taken)[0]}' is taken by the model '{other.name}'")


def _section(value: Mapping[str, Any], param: str) -> dict[str, Any]:
    """A copy of a model's settings section that the database can keep (JSON, no NUL or lone surrogate)."""
    if not isinstance(value, Mapping):
        raise ValidationFailed(f"{param} must be an object", param=param)
    try:
        text = json.dumps(dict(value), allow_nan=False)
    except (TypeError, ValueError):
        raise ValidationFailed(f"{param} must hold JSON values only", param=param) from None
    validate.storable(text, param)
    return dict(json.loads(text))
