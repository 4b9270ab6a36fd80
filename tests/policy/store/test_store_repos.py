"""The store's repositories compose into one ``PolicyStore`` without shadowing each other."""

from __future__ import annotations

import dataclasses

import pytest

from inferflux.policy.store.models import Tenant
from inferflux.policy.store.records import TenantRecord
from inferflux.policy.store.repos.base import Repository
from inferflux.policy.store.repos.mapper import RecordMapper
from inferflux.policy.store.repository import PolicyStore


def test_no_two_repositories_define_the_same_name() -> None:
    repositories = [cls for cls in PolicyStore.__bases__ if issubclass(cls, Repository)]
    assert len(repositories) == 8
    owner: dict[str, str] = {}
    for cls in repositories:
        for name in vars(cls):
            if name.startswith("__"):
                continue
            assert name not in owner, f"{cls.__name__} and {owner[name]} both define {name}"
            owner[name] = cls.__name__


def test_a_mapper_refuses_a_record_its_table_cannot_fill() -> None:
    @dataclasses.dataclass(frozen=True)
    class Wider:
        id: str
        colour: str

    with pytest.raises(TypeError, match="colour"):
        RecordMapper(Tenant, Wider)
    with pytest.raises(TypeError, match="nickname"):
        RecordMapper(Tenant, TenantRecord, nickname=str)
