"""Llama-shaped GGUF files written by benchmarks/make_shaped_gguf.py, for the backend tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "make_shaped_gguf.py"


def tiny_q4_k_m(directory: Path) -> Path:
    """The script's tiny shape (hidden 256, 2 layers) laid out as llama.cpp's Q4_K_M (Q4_K; Q6_K for the tied
    embedding and for layer 1's attn_v and ffn_down): random valid super-blocks, SmolLM2's tokenizer."""
    path = directory / "tiny-q4_k_m.gguf"
    subprocess.run([sys.executable, str(SCRIPT), str(path), "--shape", "tiny", "--type", "q4_k_m"], check=True,
                   capture_output=True)
    return path
