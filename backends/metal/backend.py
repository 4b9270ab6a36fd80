"""MetalBackend: the shared device runner on Apple GPUs (PyTorch's mps device).

Decode attention and KV stores run our Metal shaders (``kernels.metal``); the rest
is PyTorch on mps. No graphs (mps has none to capture); swap goes through plain
host memory with synchronous copies (``DeviceSwap`` off CUDA).
"""

from __future__ import annotations

import importlib.util
import platform
from typing import ClassVar

from inferflux.backends.cuda.backend import DeviceRunner


def macos_major() -> int:
    """The running macOS's major version, 0 off macOS."""
    version = platform.mac_ver()[0]
    return int(version.split(".")[0]) if version else 0


class MetalBackend(DeviceRunner):
    name: ClassVar[str] = "metal"

    @classmethod
    def machine_reason(cls) -> str | None:
        """Why this machine cannot run Metal shaders through torch, or None."""
        if platform.system() != "Darwin":
            return f"Metal needs macOS (this is {platform.system()})"
        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed"
        import torch

        if not torch.backends.mps.is_available():
            return "torch reports no usable mps device"
        if not hasattr(torch.mps, "compile_shader"):
            return f"torch {torch.__version__} cannot compile Metal shaders (torch.mps.compile_shader: 2.6 or later)"
        return None

    @classmethod
    def probe(cls) -> str | None:
        return cls.machine_reason()

    def __init__(self, num_threads: int | None = None) -> None:
        from inferflux.kernels import metal

        super().__init__("mps", metal, num_threads)

    def _auto_dtype(self) -> str:
        # bfloat16 keeps float32's range; Metal's bfloat type (and mps bf16) needs macOS 14.
        return "bfloat16" if macos_major() >= 14 else "float16"
