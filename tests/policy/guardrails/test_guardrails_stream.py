"""Streamed output checks: matches across chunk boundaries, the hold-back bound, block, flush."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferflux.policy.guardrails import PII_TYPES, Guardrails, OutputStream
from inferflux.policy.guardrails.stream import holdback

REDACT_ALL = {
    "pii": dict.fromkeys(PII_TYPES, "redact"),
    "blocklist": [{"id": "w", "literal": "bad phrase", "action": "redact"}],
}
TEXT = (
    "Sure. Write to Bob.Smith@example.com or call +44 20 7946 0958; the card is 4111 1111 1111 1111 and the "
    "IBAN DE89 3704 0044 0532 0130 00. Server 10.0.0.1, ssn 123-45-6789, ＢＯＢ＠ＥＸ．ＣＯＭ, a bad   phrase, "
    "key sk-proj-4f9XkQ2LmN8pR3sT6vW1yZ0aB. Straße, ﬁne, done."
)


def _run(stream: OutputStream, chunks: list[str] | list[bytes], *, last_with_flush: bool = False) -> tuple[str, bool]:
    """What the stream sends for ``chunks``; ``last_with_flush``: the last chunk comes with the end (``flush(last)``)."""
    sent = []
    fed = chunks[:-1] if last_with_flush and chunks else chunks
    for chunk in fed:
        step = stream.feed(chunk)
        sent.append(step.text)
        if step.blocked:
            return "".join(sent), True
    step = stream.flush(chunks[-1]) if last_with_flush and chunks else stream.flush()
    return "".join(sent) + step.text, step.blocked


ENDINGS = pytest.mark.parametrize("last_with_flush", [False, True], ids=["feed-then-flush", "flush-with-last"])


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@pytest.fixture
def guardrails(make_guardrails: Callable[..., Guardrails]) -> Guardrails:
    return make_guardrails(REDACT_ALL)


@ENDINGS
@pytest.mark.parametrize("pieces", [1, 2, 3, 7, 40, len(TEXT)])
def test_stream_equals_whole_text_check(guardrails: Guardrails, pieces: int, last_with_flush: bool) -> None:
    whole = guardrails.check_output(TEXT).texts[0]
    assert whole.count("[") == 9  # every value above is found in the whole text
    rng = random.Random(pieces)
    for _ in range(20):
        cuts = rng.sample(range(1, len(TEXT)), pieces - 1)
        assert _run(guardrails.output_stream(), _split(TEXT, cuts), last_with_flush=last_with_flush) == (whole, False)


@ENDINGS
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_utf8_bytes_split_inside_characters(guardrails: Guardrails, step: int, last_with_flush: bool) -> None:
    data = TEXT.encode()
    chunks = [data[i : i + step] for i in range(0, len(data), step)]
    sent = _run(guardrails.output_stream(), chunks, last_with_flush=last_with_flush)
    assert sent == (guardrails.check_output(TEXT).texts[0], False)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.booleans())
def test_any_split_of_generated_text_decides_like_the_whole(data: st.DataObject, last_with_flush: bool) -> None:
    from inferflux.policy.guardrails import parse_spec

    guardrails = Guardrails([parse_spec(REDACT_ALL)])
    words = ["bob@ex.com", "+1 202 555 0173", "4111 1111 1111 1111", "10.0.0.1", "bad", "phrase", "x", "ß",
             "1.2.3", "２", "\u200b", " ", "  ", "-", ".", "ssn", "123-45-6789", "DE89", "3704"]  # fmt: skip
    text = "".join(data.draw(st.lists(st.sampled_from(words), max_size=30)))
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=10)) if len(text) > 1 else []
    sent = _run(guardrails.output_stream(), _split(text, cuts), last_with_flush=last_with_flush)
    assert sent == (guardrails.check_output(text).texts[0], False)


def test_text_is_released_promptly_with_a_bounded_holdback(guardrails: Guardrails) -> None:
    spaced, word = holdback(guardrails.output_matchers)
    assert spaced == 65  # a PEM header (63) + look-ahead
    stream = guardrails.output_stream()
    prose = "the quick brown fox jumps over the lazy dog " * 10
    sent = "".join(stream.feed(ch).text for ch in prose)
    held = len(prose) - len(sent)
    assert 0 < held <= spaced
    assert sent == prose[: len(sent)]
    assert sent + stream.flush().text == prose


def test_without_output_rules_nothing_is_held(make_guardrails: Callable[..., Guardrails]) -> None:
    stream = make_guardrails({"pii": {"email": {"mode": "redact", "direction": "input"}}}).output_stream()
    assert stream.feed("bob@example.com").text == "bob@example.com"


@ENDINGS
def test_block_ends_the_stream_after_the_clean_text(
    make_guardrails: Callable[..., Guardrails], last_with_flush: bool
) -> None:
    stream = make_guardrails({"pii": {"card": "block"}}).output_stream()
    chunks = ["Here it is: ", "4111 1111 ", "1111 1111", " enjoy", " more text to come " * 5]
    sent, blocked = _run(stream, chunks, last_with_flush=last_with_flush)
    assert blocked and stream.blocked
    assert sent == "Here it is: "
    assert "4111" not in sent
    assert stream.feed("more").blocked and stream.flush().blocked
    assert [f.rule for f in stream.findings] == ["pii.card"]


def test_block_at_flush(make_guardrails: Callable[..., Guardrails]) -> None:
    stream = make_guardrails({"blocklist": [{"id": "w", "literal": "ski"}]}).output_stream()
    assert stream.feed("we go sk").text == "we go "  # only the trailing word could still become "ski"
    assert stream.feed("i").text == ""  # ... or "skip"
    step = stream.flush()
    assert step.blocked and step.text == "" and step.reasons


def test_private_key_is_held_until_its_end_line(guardrails: Guardrails) -> None:
    stream = guardrails.output_stream()
    sent = stream.feed("key: -----BEGIN PRIVATE KEY-----\n").text
    for line in ["MIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n"] * 30:
        sent += stream.feed(line).text
    assert "MIIE" not in sent
    sent += stream.feed("-----END PRIVATE KEY-----\nthat was it, " + "and more " * 10).text
    assert "MIIE" not in sent and "[SECRET]" in sent
    assert sent + stream.flush().text == "key: [SECRET]\nthat was it, " + "and more " * 10


def test_unterminated_private_key_is_redacted_to_the_end(guardrails: Guardrails) -> None:
    out, blocked = _run(guardrails.output_stream(), ["-----BEGIN EC PRIVATE KEY-----\nMHcCAQEE", "IBsecret"])
    assert (out, blocked) == ("[SECRET]", False)


def test_findings_carry_offsets_in_the_whole_output(guardrails: Guardrails) -> None:
    stream = guardrails.output_stream()
    _run(stream, _split(TEXT, list(range(5, len(TEXT), 11))))
    spans = [(f.type, TEXT[f.start : f.end]) for f in stream.findings]
    assert ("email", "Bob.Smith@example.com") in spans
    assert ("email", "ＢＯＢ＠ＥＸ．ＣＯＭ") in spans
    assert ("card", "4111 1111 1111 1111") in spans
    assert len(spans) == 9
    assert all(f.index == 0 for f in stream.findings)


def test_a_stream_given_its_holdback_decides_as_one_that_computes_it(guardrails: Guardrails) -> None:
    matchers = guardrails.output_matchers
    chunks = _split(TEXT, list(range(3, len(TEXT), 7)))
    given = _run(OutputStream(matchers, holdback(matchers)), chunks)
    assert given == _run(OutputStream(matchers), chunks) == _run(guardrails.output_stream(), chunks)
    # A wrong hold-back changes what is released when: the parameter is really used.
    steps = [OutputStream(matchers, hold).feed(TEXT[:120]).text for hold in [holdback(matchers), (0, 0)]]
    assert steps[0] != steps[1]


@pytest.mark.parametrize("with_rules", [True, False])
def test_incomplete_utf8_before_a_str_chunk_or_the_end(
    make_guardrails: Callable[..., Guardrails], with_rules: bool
) -> None:
    spec = {"blocklist": [{"id": "w", "literal": "ski"}]} if with_rules else {}
    stream = make_guardrails(spec).output_stream()
    # "é" is b"\xc3\xa9": its first byte alone, then a str, becomes U+FFFD, as a decoder ending there gives.
    sent = stream.feed("caf").text + stream.feed(b"\xc3").text + stream.feed(" ok ").text
    sent += stream.feed(b"\xe2\x82").text + stream.flush().text
    assert sent == "caf\ufffd ok \ufffd"
    assert b"\xc3".decode("utf-8", "replace") == b"\xe2\x82".decode("utf-8", "replace") == "\ufffd"
