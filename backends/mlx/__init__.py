"""MLX backend: the model in MLX arrays (runner not built yet)."""

from __future__ import annotations

import importlib.util

from backends._unbuilt import UnbuiltBackend


class MLXBackend(UnbuiltBackend):
    name = "mlx"

    @classmethod
    def machine_reason(cls) -> str | None:
        if importlib.util.find_spec("mlx") is None:
            return "MLX is not installed (pip install 'inferflux[mlx]')"
        return None
