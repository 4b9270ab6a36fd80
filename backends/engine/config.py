"""The engine's sizes (``EngineConfig``) and how they resolve against a backend and a model.

``LLMEngine`` checks its configuration once at construction and asks here how
many KV blocks, swap slots and context positions it gets: the cache given in
blocks or in bytes (divided by the backend's block size), the context capped
by the model's own, swap space as many blocks as the cache unless told.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from inferflux.backends.base import Backend, ModelInfo, default_block_size

from .block_manager import DEFAULT_BLOCK_SIZE
from .errors import EngineConfigError
from .scheduler import PREEMPTION_MODES
from .speculative import SpeculativeConfig

DEFAULT_KV_CACHE_BYTES = 1 << 30  # used when neither num_blocks nor kv_cache_bytes is set


@dataclass
class EngineConfig:
    """Sizes of the KV cache and of a step.

    Give the cache either as ``num_blocks`` or as ``kv_cache_bytes`` (divided by
    the backend's ``kv_block_bytes(block_size)``), not both; with neither,
    ``DEFAULT_KV_CACHE_BYTES`` is used. ``max_model_len`` defaults to the
    model's context length and may only lower it. ``block_size`` None takes the
    backend's ``default_block_size`` (``with_block_size``).
    """

    block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    # Reuse the KV of full blocks of earlier prompts (and outputs) with the same
    # prefix; requests only share within the same ``cache_salt``.
    enable_prefix_caching: bool = True
    # Speculative decoding (``speculative.SpeculativeConfig``); None: off.
    speculative: SpeculativeConfig | None = None
    # What preemption does with a sequence's KV: "recompute" drops it (prefilled
    # again on readmission), "swap" parks it in swap space (needs a backend with
    # ``allocate_swap``). Swap space holds ``num_swap_blocks`` or
    # ``swap_space_bytes`` worth of blocks (default: as many as the KV cache), in
    # host memory, or in a file under ``swap_dir`` when it is set (the disk tier).
    preemption_mode: str = "recompute"
    num_swap_blocks: int | None = None
    swap_space_bytes: int | None = None
    swap_dir: str | None = None
    # The compiled-grammar cache's bound in estimated bytes (``grammar_compiler``); None: its default.
    grammar_cache_bytes: int | None = None

    def check(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            _positive(name, getattr(self, name))
        for name in ("block_size", "num_blocks", "kv_cache_bytes", "max_model_len", "num_swap_blocks",
                     "swap_space_bytes", "grammar_cache_bytes"):  # fmt: skip
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise EngineConfigError("set num_blocks or kv_cache_bytes, not both")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise EngineConfigError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}"
            )
        if self.num_swap_blocks is not None and self.swap_space_bytes is not None:
            raise EngineConfigError("set num_swap_blocks or swap_space_bytes, not both")
        if self.swap_dir is not None and (not isinstance(self.swap_dir, str) or not self.swap_dir):
            raise EngineConfigError(f"swap_dir must be a directory path, got {self.swap_dir!r}")
        if self.speculative is not None:
            if not isinstance(self.speculative, SpeculativeConfig):
                raise EngineConfigError("speculative must be a SpeculativeConfig or None")
            self.speculative.check()


def block_size_for(backend: Backend, config: EngineConfig) -> int:
    """The KV block size: the configuration's, else the backend's default, else ``DEFAULT_BLOCK_SIZE``."""
    if config.block_size is not None:
        return config.block_size
    return default_block_size(backend, DEFAULT_BLOCK_SIZE)


def with_block_size(backend: Backend, config: EngineConfig) -> EngineConfig:
    """``config`` with its block size settled (``block_size_for``)."""
    return config if config.block_size is not None else replace(config, block_size=block_size_for(backend, config))


def resolve_num_blocks(backend: Backend, config: EngineConfig) -> int:
    """The KV cache's blocks: ``num_blocks``, or the byte budget over the backend's block size."""
    if config.num_blocks is not None:
        return config.num_blocks
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
    block_size = block_size_for(backend, config)
    block_bytes = backend.kv_block_bytes(block_size)
    if block_bytes <= 0:
        raise EngineConfigError(f"backend reports {block_bytes} bytes per KV block")
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise EngineConfigError(
            f"kv_cache_bytes={budget} is smaller than one KV block ({block_bytes} bytes "
            f"for {block_size} tokens)"
        )
    return num_blocks


def resolve_max_model_len(info: ModelInfo, config: EngineConfig) -> int:
    """The usable context: the model's, or the configuration's lower one."""
    if config.max_model_len is None:
        return info.context_length
    if config.max_model_len > info.context_length:
        raise EngineConfigError(
            f"max_model_len={config.max_model_len} exceeds the model's context length {info.context_length}"
        )
    return config.max_model_len


def allocate_swap(backend: Backend, config: EngineConfig, num_blocks: int) -> int:
    """Reserve the swap space "swap" preemption needs; the number of slots (0 without)."""
    if config.preemption_mode != "swap":
        return 0
    allocate = getattr(backend, "allocate_swap", None)
    if allocate is None:
        raise EngineConfigError(
            f"preemption_mode 'swap' needs a backend that can swap; {type(backend).__name__} cannot "
            "(use preemption_mode 'recompute')"
        )
    block_size = block_size_for(backend, config)
    if config.num_swap_blocks is not None:
        slots = config.num_swap_blocks
    elif config.swap_space_bytes is not None:
        slots = config.swap_space_bytes // backend.kv_block_bytes(block_size)
        if slots < 1:
            raise EngineConfigError(f"swap_space_bytes={config.swap_space_bytes} is smaller than one KV block")
    else:
        slots = num_blocks
    allocate(slots, block_size, config.swap_dir)
    return slots


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
