"""CUDA/ROCm backend: the shared Transformer on the GPU with Triton kernels and CUDA graphs."""

from inferflux.backends.cuda.backend import CUDABackend, DeviceRunner

__all__ = ["CUDABackend", "DeviceRunner"]
