"""The CPU backend: PyTorch on the host, paged KV in preallocated host tensors."""

from inferflux.backends.cpu.backend import CPUBackend

__all__ = ["CPUBackend"]
