"""The MLX backend: the model in MLX arrays, paged KV in MLX arrays (Apple silicon's
GPU through Metal, or mlx's CPU build on Linux). mlx itself is imported lazily."""

from inferflux.backends.mlx.backend import MLXBackend

__all__ = ["MLXBackend"]
