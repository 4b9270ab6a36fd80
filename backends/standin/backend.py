"""StandinBackend: the engine's host loop against a device whose step takes a known time.

The engine, sampler, detokenizer and gateway cannot tell it from a real backend: ``load``
reads the real model file's config and tokenizer, so prompts, chat templates, detokenising
and stop strings are real. What it does not do is compute: the KV cache is bookkeeping only,
and ``forward`` waits ``base + per_row x rows`` seconds (``rows``: the batch's tokens, every
prefill chunk token and decode token a row of the activations) in ``time.sleep``, which
releases the GIL as a GPU's synchronising wait does, so the host's own work around it can be
measured on any machine (issue 47). A busy-wait would hold the GIL and a core, and measure
nothing but itself.

Its logits are a function of the input ids alone: each row puts a high logit on one
pseudo-random ordinary token and a lower one on a second, chosen from (the row's token, its
position). Greedy decoding is therefore a fixed, real token stream, and temperature sampling
still has a choice to make.

It is off unless ``INFERFLUX_STANDIN_STEP`` is set (``probe`` says so): ``--backend standin``
alone cannot start it, ``auto`` never picks it (it is in no default chain), and
``INFERFLUX_BACKENDS_ALLOWED`` keeps it out of a production server like any plugin.
"""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from inferflux.backends.base import Batch, BackendError, ModelInfo, ModelSpec

log = logging.getLogger(__name__)

STEP_ENV = "INFERFLUX_STANDIN_STEP"
# Logits of a row: the chosen token well above the rest (e^20 outweighs 49k zero logits, so
# temperature 1 still mostly follows the greedy stream), a runner-up a little below it.
TOP_LOGIT, SECOND_LOGIT = 20.0, 18.0
_MAX_STEP_MS = 10_000.0  # a step longer than 10 s is a typo, not a device


@dataclass(frozen=True)
class StepTime:
    """How long a step of ``rows`` rows takes: ``base_s + per_row_s * rows`` seconds."""

    base_s: float
    per_row_s: float

    @classmethod
    def parse(cls, text: str) -> StepTime:
        """``"BASE_MS,PER_ROW_MS"`` in milliseconds, e.g. ``"1.4,0.04"``; ValueError says what is wrong."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 2:
            raise ValueError(f"{STEP_ENV} takes BASE_MS,PER_ROW_MS (e.g. 1.4,0.04), not {text!r}")
        try:
            base, per_row = float(parts[0]), float(parts[1])
        except ValueError:
            raise ValueError(f"{STEP_ENV}: {text!r} is not two numbers of milliseconds") from None
        for value in (base, per_row):
            if not math.isfinite(value) or not 0 <= value <= _MAX_STEP_MS:
                raise ValueError(f"{STEP_ENV}: each figure is 0 to {_MAX_STEP_MS:g} ms, not {value!r}")
        return cls(base / 1e3, per_row / 1e3)

    @classmethod
    def from_env(cls) -> StepTime:
        raw = os.environ.get(STEP_ENV, "")
        if not raw.strip():
            raise ValueError(f"{STEP_ENV} is not set")
        return cls.parse(raw)

    def seconds(self, rows: int) -> float:
        return self.base_s + self.per_row_s * rows


class StandinBackend:
    name: ClassVar[str] = "standin"
    default_block_size: ClassVar[int] = 16  # the accelerator runners' size (backends.cuda)

    @classmethod
    def probe(cls) -> str | None:
        try:
            StepTime.from_env()
        except ValueError as exc:
            return (f"a measuring tool for the host loop, not a model: set {STEP_ENV}=BASE_MS,PER_ROW_MS "
                    f"to use it ({exc}; docs/backends.md)")
        return None

    def __init__(self) -> None:
        try:
            self.step_time = StepTime.from_env()
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        self.info: ModelInfo | None = None
        self.block_size = 0
        self.num_blocks = 0
        self._ordinary = np.zeros(0, dtype=np.int64)  # the token ids a row may pick (load)
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="standin-device")

    # -- loading: the real file's config and tokenizer, no weights

    def load(self, spec: ModelSpec) -> ModelInfo:
        from inferflux.backends.models import ModelLoadError, open_model

        if spec.deterministic:
            raise BackendError("deterministic mode runs on the cpu backend only, not on standin")
        try:
            source = open_model(spec.path)
            try:
                cfg, tokenizer = source.config, source.tokenizer()
            finally:
                source.close()
        except ModelLoadError as exc:
            raise BackendError(f"cannot load {spec.path}: {exc}") from exc
        self._ordinary = ordinary_tokens(tokenizer, cfg.vocab_size)
        if not len(self._ordinary):
            raise BackendError(f"{spec.path}: no ordinary printable token to generate")
        self.info = cfg.model_info(spec.name, "bfloat16")  # what the accelerator it stands in for would run
        log.warning("standin backend: %s is NOT computed: each step waits %.3f ms + %.4f ms a row (%s); "
                    "a measuring tool only", spec.name, self.step_time.base_s * 1e3, self.step_time.per_row_s * 1e3,
                    STEP_ENV)  # fmt: skip
        return self.info

    # -- KV cache: bookkeeping only

    def kv_block_bytes(self, block_size: int) -> int:
        # The bytes a bfloat16 cache would take, so a memory budget gives the real model's block count.
        info = self._info
        return 2 * info.num_layers * block_size * info.num_kv_heads * info.head_dim * 2

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self._info  # raises before load
        self.num_blocks, self.block_size = num_blocks, block_size

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        for src, dst in pairs:  # nothing to copy; a bad index is still the engine's bug
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise BackendError(f"copy_blocks: block pair {(src, dst)} outside 0..{self.num_blocks - 1}")

    # -- the step

    def forward(self, batch: Batch) -> Any:
        started = time.perf_counter()
        if self.info is None or not self.block_size:
            raise BackendError("forward called before load() and allocate_kv()")
        if batch.block_size != self.block_size:
            raise BackendError(f"batch block size {batch.block_size} != cache block size {self.block_size}")
        # The logits are made on the "device" (a thread of its own) while this thread waits, as a device's
        # are: made here, zeroing a fresh [rows, vocab] array (6 MB at 32 rows) cost this thread 0.4 ms a
        # step, which the engine-thread CPU counter would have charged to the host loop.
        logits = self._device.submit(self.logits, batch)
        # The wait covers the logits' making too: the step takes the formula's time, not more.
        remaining = started + self.step_time.seconds(batch.num_tokens) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return logits.result()

    def logits(self, batch: Batch) -> np.ndarray:
        """float32 ``[batch.num_logits, vocab]``: each row's two peaks (module docstring), zeros elsewhere."""
        last: list[int] = []
        positions: list[int] = []
        for s in batch.slices:
            n = len(s.token_ids)
            for j in range(n - s.num_logits, n):  # the rows of a slice's last num_logits tokens
                last.append(int(s.token_ids[j]))
                positions.append(s.start_pos + j)
        first, second = next_tokens(np.asarray(last, dtype=np.uint64), np.asarray(positions, dtype=np.uint64),
                                    self._ordinary)  # fmt: skip
        out = np.zeros((len(last), self._info.vocab_size), dtype=np.float32)
        rows = np.arange(len(last))
        out[rows, second] = SECOND_LOGIT
        out[rows, first] = TOP_LOGIT  # after the runner-up: where the two coincide, the top wins
        return out

    @property
    def _info(self) -> ModelInfo:
        if self.info is None:
            raise BackendError("no model loaded: call load() first")
        return self.info


def next_tokens(last: np.ndarray, positions: np.ndarray, ordinary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The top and runner-up token of each row, from its token and position (splitmix64's mix)."""
    with np.errstate(over="ignore"):
        h = last * np.uint64(0x9E3779B97F4A7C15) + positions * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(1)
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    span = np.uint64(len(ordinary))
    return ordinary[(h % span).astype(np.int64)], ordinary[((h >> np.uint64(32)) % span).astype(np.int64)]


def ordinary_tokens(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Ids that decode alone to printable ASCII and are no added (special) token: the stream reads
    as text, never ends on EOS and never holds back a half UTF-8 character."""
    backend = tokenizer.backend
    limit = min(vocab_size, tokenizer.vocab_size)
    added = set(backend.get_added_tokens_decoder())
    texts = backend.decode_batch([[i] for i in range(limit)], skip_special_tokens=False)
    keep = [i for i, text in enumerate(texts) if i not in added and text and text.isascii() and text.isprintable()]
    return np.asarray(keep, dtype=np.int64)
