"""Metal backend: PyTorch on the mps device with our own Metal shaders for paged attention."""

from inferflux.backends.metal.backend import MetalBackend

__all__ = ["MetalBackend"]
