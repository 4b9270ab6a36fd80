"""The CPU backend's ``passes`` section checked (``PassConfig``), what one pass did (``PassRecord``),
the ``quantise`` modes by what each keeps of the weights, and the dtype a dense mode loads in.

``passes.py`` runs the pipeline; ``quantise.py`` is its ``quantise`` pass. Imports
no tensor library, so the settings can check a section without loading torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

MODES = ("auto", "blocks", "native", "hybrid", "exact", "int8", "int4", "bf16", "f32")
FILE_BLOCK_MODES = ("blocks", "native", "hybrid", "exact")  # the modes that keep the file's own blocks
KEEP_DENSE_MODES = ("hybrid", "exact")  # the modes that keep the loaded dense weights beside the blocks
EXACT_MODES = ("blocks", "exact")  # the modes whose blocks are multiplied by exact_linear
DENSE_DTYPES = {"bf16": "bfloat16", "f32": "float32"}  # the dense modes, and the dtype each loads in
_KEYS = ("quantise", "gemm_from", "pack", "decode_loop")


@dataclass(frozen=True)
class PassConfig:
    """``passes`` in the settings (``engine.passes``, ``models[].passes``, admin model load)."""

    quantise: str = "auto"
    gemm_from: int | None = None  # rows from which quantised projections use the GEMM path
    pack: bool | None = None  # bfloat16 dense weights packed once for oneDNN; None: yes
    decode_loop: bool | None = None  # the C++ loop over layers for decode steps where it applies; None: yes

    @classmethod
    def parse(cls, value: Mapping[str, Any] | None) -> PassConfig:
        """Validate a ``passes`` mapping; ``ValueError`` naming the bad key or value."""
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError("passes must be a mapping, e.g. {quantise: native}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"passes: unknown key {unknown[0]!r}; known: {', '.join(_KEYS)}")
        mode = value.get("quantise", "auto")
        if mode not in MODES:
            raise ValueError(f"passes.quantise must be one of {', '.join(MODES)}, not {mode!r}")
        gemm_from = value.get("gemm_from")
        if gemm_from is not None and (isinstance(gemm_from, bool) or not isinstance(gemm_from, int)
                                      or not 1 <= gemm_from <= 1 << 20):
            raise ValueError(f"passes.gemm_from must be an integer from 1 to {1 << 20}, not {gemm_from!r}")
        flags = {key: value.get(key) for key in ("pack", "decode_loop")}
        for key, flag in flags.items():
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(f"passes.{key} must be true or false, not {flag!r}")
        return cls(quantise=mode, gemm_from=gemm_from, **flags)

    def merged(self, override: PassConfig | None) -> PassConfig:
        """A model's own passes over the engine's: each key the model sets wins."""
        if override is None:
            return self
        return PassConfig(quantise=override.quantise if override.quantise != "auto" else self.quantise,
                          gemm_from=override.gemm_from if override.gemm_from is not None else self.gemm_from,
                          pack=override.pack if override.pack is not None else self.pack,
                          decode_loop=override.decode_loop if override.decode_loop is not None else self.decode_loop)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class PassRecord:
    name: str
    status: str  # "ran" | "done at load" | "skipped"
    detail: str
    bytes_before: int
    bytes_after: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def requested_dtype(dtype: str, config: PassConfig) -> str:
    """The dtype to load in: ``bf16``/``f32`` name one (which an explicit, different dtype contradicts)."""
    want = DENSE_DTYPES.get(config.quantise)
    if want is None or dtype == want:
        return dtype
    if dtype != "auto":
        raise ValueError(f"passes.quantise {config.quantise} contradicts dtype {dtype}")
    return want
