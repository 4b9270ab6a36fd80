"""Shared shape of the accelerator backends whose runners are not built yet.

They are registered so that discovery, `inferctl backends` and the priority chain
see them and report plainly why they cannot serve on this machine.
"""

from __future__ import annotations

from typing import Any, ClassVar

from backends.base import BackendError


class UnbuiltBackend:
    name: ClassVar[str]

    @classmethod
    def machine_reason(cls) -> str | None:
        """Why this machine lacks the hardware or toolkit, or None if it has it."""
        raise NotImplementedError

    @classmethod
    def probe(cls) -> str | None:
        reason = cls.machine_reason()
        if reason is not None:
            return reason
        return f"the {cls.name} model runner is not implemented in this release"

    def _unavailable(self, *_: Any, **__: Any) -> Any:
        raise BackendError(str(self.probe()))

    load = _unavailable  # type: ignore[assignment]
    kv_block_bytes = _unavailable
    allocate_kv = _unavailable
    forward = _unavailable
    copy_blocks = _unavailable

    def __init__(self, *_: Any, **__: Any) -> None:
        self._unavailable()

