"""A package's exported names, imported on first use (PEP 562), so that importing the package stays cheap.

The server's settings and ``inferctl --help`` import ``policy.store`` and
``policy.audit`` for a name or two; loading SQLAlchemy, Alembic or the audit
sinks for that would cost more than the command itself.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]) -> tuple[list[str], Callable[[str], Any]]:
    """``__all__`` and the module ``__getattr__`` of ``package``, which exports each module's names.

    In the package's ``__init__``::

        __all__, __getattr__ = lazy_exports(__name__, {"package.module": ("Name", ...), ...})

    with the same names imported under ``if TYPE_CHECKING:`` for type checkers.
    """
    where = {name: module for module, names in exports.items() for name in names}
    namespace = vars(sys.modules[package])

    def load(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # found without this function from now on
        return value

    return sorted(where), load
