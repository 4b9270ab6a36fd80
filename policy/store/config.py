"""Settings for the policy store (the ``store:`` section of the server's settings)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

# A URL naming no driver gets the one InferFlux ships with.
_DRIVERS = {"postgresql": "postgresql+psycopg", "postgres": "postgresql+psycopg", "sqlite": "sqlite"}
_SUPPORTED = {"postgresql+psycopg", "sqlite", "sqlite+pysqlite"}


def normalize_url(url: str) -> URL:
    """Parse a store URL, mapping ``postgresql://`` to the psycopg 3 driver; ValueError if unsupported."""
    # Imported here: the server's settings import this module, and SQLAlchemy
    # is not needed to print --help.
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(
            "not a database URL (e.g. sqlite:////srv/inferflux/policy.db or postgresql://host/db)"
        ) from None
    drivername = _DRIVERS.get(parsed.drivername, parsed.drivername)
    if drivername not in _SUPPORTED:
        raise ValueError(f"unsupported database {parsed.drivername!r}: use sqlite:/// or postgresql://")
    if drivername.startswith("sqlite") and parsed.database in (None, "", ":memory:"):
        raise ValueError(
            "an in-memory SQLite store would lose everything at exit; name a file (sqlite:////path/policy.db)"
        )
    return parsed.set(drivername=drivername)


class StoreSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # None: SQLite at <data_dir>/policy.db.
    url: str | None = None
    # Exactly one of these, or neither: then <data_dir>/store.key, generated on first start.
    key_file: Path | None = None
    passphrase: SecretStr | None = None
    # Migrate the schema to this release's at start-up; off, a server refuses an older schema.
    auto_migrate: bool = True
    # PostgreSQL connection pool, per process.
    pool_size: int = Field(default=5, ge=1, le=100)
    max_overflow: int = Field(default=10, ge=0, le=100)
    pool_timeout_seconds: float = Field(default=10.0, gt=0)
    pool_recycle_seconds: int = Field(default=1800, ge=-1)
    # SQLite: how long a writer waits for another's lock before giving up.
    sqlite_busy_timeout_ms: int = Field(default=5000, ge=0)
    # While the store is unreachable, decisions already cached (keys, roles, limits,
    # guardrails) keep serving for this long after its last successful read
    # (policy.snapshot); then requests needing the store get 503 and /readyz fails.
    stale_seconds: float = Field(default=300.0, ge=0, le=86400)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None:
            normalize_url(value)  # rejects what cannot be opened, before anything starts
        return value or None

    @field_validator("key_file", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        return Path(value).expanduser() if isinstance(value, str | Path) and str(value) else None

    @field_validator("passphrase", mode="before")
    @classmethod
    def _empty_passphrase(cls, value: Any) -> Any:
        return None if value == "" else value

    @model_validator(mode="after")
    def _one_key_source(self) -> StoreSettings:
        if self.key_file is not None and self.passphrase is not None:
            raise ValueError("set either store.key_file or store.passphrase, not both")
        return self

    def database_url(self, data_dir: Path) -> URL:
        if self.url is not None:
            return normalize_url(self.url)
        from sqlalchemy.engine import URL

        return URL.create("sqlite", database=str(data_dir / "policy.db"))  # no parsing: any path is fine
