"""Metal backend: PyTorch on the mps device with Metal shaders (runner not built yet)."""

from __future__ import annotations

import importlib.util
import platform

from backends._unbuilt import UnbuiltBackend


class MetalBackend(UnbuiltBackend):
    name = "metal"

    @classmethod
    def machine_reason(cls) -> str | None:
        if platform.system() != "Darwin":
            return f"Metal needs macOS (this is {platform.system()})"
        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed"
        import torch

        if not torch.backends.mps.is_available():
            return "torch reports no usable mps device"
        return None
