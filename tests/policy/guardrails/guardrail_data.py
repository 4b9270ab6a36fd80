"""The shipped test data of the guardrail tests (``tests/data``, its README says where it comes from)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"


def blocklist_words() -> list[str]:
    """A realistic English blocklist: profanities and sensitive words, none of them in the corpus."""
    return (DATA / "blocklist-en.txt").read_text("utf-8").split()


def corpus() -> str:
    """About 300 KB of benign English (Shakespeare, public domain)."""
    return (DATA / "tinyshakespeare-300k.txt").read_text("utf-8")


def blocklist_spec(**extra: object) -> dict[str, object]:
    return {"blocklist": [{"id": f"w{i}", "literal": word} for i, word in enumerate(blocklist_words())], **extra}
