"""CUDA/ROCm backend: PyTorch on the GPU with Triton kernels (runner not built yet)."""

from __future__ import annotations

import importlib.util

from backends._unbuilt import UnbuiltBackend


class CUDABackend(UnbuiltBackend):
    name = "cuda"

    @classmethod
    def machine_reason(cls) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed"
        import torch

        if not torch.cuda.is_available():
            return f"no CUDA or ROCm device is visible to torch {torch.__version__}"
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed (pip install 'inferflux[cuda]')"
        return None
