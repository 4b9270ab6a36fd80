"""The false-positive rate of the matching skeleton on benign English: under 0.5%.

Definition: the share of the corpus's paragraphs (blank-line separated speeches, 2,000 and more of
them, a prompt's size) that a realistic blocklist of 50 words (``tests/data/blocklist-en.txt``) blocks,
each checked as a request of its own, and each pair of consecutive paragraphs as a two-message
conversation (so the cross-message check counts too). None of the words occurs in the corpus as a
whole word (checked below), so every block is a false positive: a word made by the skeleton (look-alikes,
spelled-out letters joined) or by joining two messages.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from guardrail_data import blocklist_spec, blocklist_words, corpus

from inferflux.policy.guardrails import Guardrails

MAX_RATE = 0.005


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    return [p for p in corpus().split("\n\n") if p.strip()]


def test_no_blocklisted_word_is_in_the_corpus_as_a_word() -> None:
    words = set(re.findall(r"[a-z]+", corpus().lower()))
    assert not words & set(blocklist_words())


def test_the_false_positive_rate_on_benign_english_is_under_half_a_percent(
    make_guardrails: Callable[..., Guardrails], paragraphs: list[str]
) -> None:
    guards = make_guardrails(blocklist_spec())
    assert len(paragraphs) > 2000
    alone = sum(guards.check_input([p]).blocked for p in paragraphs)
    pairs = sum(guards.check_input([a, b]).blocked for a, b in zip(paragraphs, paragraphs[1:]))
    rate = (alone + pairs) / (2 * len(paragraphs) - 1)
    print(f"false positives: {alone} of {len(paragraphs)} paragraphs, {pairs} of {len(paragraphs) - 1} pairs")
    assert rate < MAX_RATE


@pytest.mark.parametrize(
    "text",
    [
        "class as sets",
        "a s-curve and a t-shirt",  # single letters next to words, not to each other
        "Plan B. A new start",
        "I am a fan of the U.S. Navy",
        "rock 'n' roll",
        "x = a + b - c",
        "options (a), (b) and (c)",
        "the numbers 4 1 1 1 and 5 5",  # digits never join
    ],
)
def test_separators_do_not_glue_ordinary_words(make_guardrails: Callable[..., Guardrails], text: str) -> None:
    guards = make_guardrails({"blocklist": [{"id": w, "literal": w} for w in ("ass", "sass", "pan", "ab", "bac")]})
    assert not guards.check_input([text]).blocked
