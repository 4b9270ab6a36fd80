"""The guardrail case table: obfuscated blocklist words, PII variants, PII split across stream
chunks, and benign near-misses that must pass unchanged.

One policy for all cases: the blocklist words ``ski``, ``fire`` and ``bad phrase`` and
the regex ``forbidden\\d+`` block; every PII type is redacted. Each case is a text (or
the chunks of a streamed response) and what must come out: ``BLOCK``, or the text the
client receives.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from inferflux.policy.authn.apikeys import generate_key
from inferflux.policy.guardrails import PII_TYPES, Action, ContentFiltered, Guardrails



BLOCK = "BLOCK"
SPEC = {
    "blocklist": [
        {"id": "ski", "literal": "ski"},
        {"id": "fire", "literal": "FIRE"},
        {"id": "phrase", "literal": "bad phrase"},
        {"id": "code", "regex": r"forbidden\d+"},
    ],
    "pii": dict.fromkeys(PII_TYPES, "redact"),
}
IFX_KEY = generate_key().token
JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ"
    ".SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)
PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA7bq\nQ2xvdWQ=\n-----END RSA PRIVATE KEY-----"

CASES = [
    # -- obfuscated blocklist words: blocked
    ("word-mixed-case", "let's go SKI tomorrow", BLOCK),
    ("word-fullwidth", "let's go ｓｋｉ", BLOCK),
    ("word-zero-width-space", "let's go s\u200bki", BLOCK),
    ("word-zero-width-joiners", "s\u200dk\u200ci season", BLOCK),
    ("word-soft-hyphen", "S\u00adKI!", BLOCK),
    ("word-variation-selector", "ski\ufe0f time", BLOCK),
    ("word-circled-letters", "ⓢⓚⓘ", BLOCK),
    ("word-control-char", "s\x00ki", BLOCK),
    ("word-ligature", "open ﬁre now", BLOCK),
    ("phrase-fullwidth-ideographic-space", "ＢＡＤ\u3000ＰＨＲＡＳＥ", BLOCK),
    ("phrase-whitespace-run", "a bad\n\t   phrase here", BLOCK),
    ("regex-case-folded", "see FORBIDDEN42", BLOCK),
    ("regex-fullwidth-digits", "see forbidden４２", BLOCK),
    # -- near misses for the blocklist: pass unchanged
    ("word-inside-skip", "skip the line", "skip the line"),
    ("word-inside-skiing", "I love skiing", "I love skiing"),
    ("word-inside-mosquito", "a moskito bite", "a moskito bite"),
    ("phrase-split-words-pass", "bad phrases", "bad phrases"),
    ("word-dotted", "s.k.i trip", BLOCK),
    ("word-spaced", "S K I trip", BLOCK),
    ("word-cyrillic", "\u0455k\u0456 trip", BLOCK),
    ("word-accented", "ski\u0301 trip", BLOCK),
    # documented limit: leetspeak is not undone
    ("word-leetspeak-not-handled", "sk1 trip", "sk1 trip"),
    # -- PII: redacted
    ("email", "mail bob.smith+tag@example.co.uk now", "mail [EMAIL] now"),
    ("email-fullwidth", "ＢＯＢ＠ＥＸＡＭＰＬＥ．ＣＯＭ", "[EMAIL]"),
    ("email-zero-width-inside", "bob\u200b@example.com!", "[EMAIL]!"),
    ("phone-international", "call +44 20 7946 0958 today", "call [PHONE] today"),
    ("phone-international-dashes", "call +1-202-555-0173.", "call [PHONE]."),
    ("phone-us-parentheses", "call (202) 555-0173 now", "call [PHONE] now"),
    ("phone-us-dots", "call 202.555.0173", "call [PHONE]"),
    ("phone-germany-trunk", "ruf +49 (0)30 1234567 an", "ruf [PHONE] an"),
    ("card-spaces", "card 4111 1111 1111 1111 exp 12/27", "card [CARD] exp 12/27"),
    ("card-dashes", "card 5500-0000-0000-0004.", "card [CARD]."),
    ("card-amex-plain", "amex 378282246310005", "amex [CARD]"),
    ("card-fullwidth", "card ４１１１１１１１１１１１１１１１", "card [CARD]"),
    ("iban-grouped", "IBAN DE89 3704 0044 0532 0130 00, thanks", "IBAN [IBAN], thanks"),
    ("iban-compact", "GB82WEST12345698765432", "[IBAN]"),
    ("ssn-dashes", "ssn 123-45-6789", "ssn [SSN]"),
    ("ssn-spaces", "ssn 123 45 6789.", "ssn [SSN]."),
    ("ipv4", "host 192.168.1.20:8080", "host [IP]:8080"),
    ("ipv6", "addr 2001:db8::8a2e:370:7334 ok", "addr [IP] ok"),
    ("secret-openai", "key sk-proj-4f9XkQ2LmN8pR3sT6vW1yZ0aB", "key [SECRET]"),
    ("secret-github", "token ghp_16C7e42F292c6912E7710c838347Ae178B4a rotated", "token [SECRET] rotated"),
    ("secret-aws", "AKIAIOSFODNN7EXAMPLE", "[SECRET]"),
    ("secret-ifx-key", f"use {IFX_KEY} here", "use [SECRET] here"),
    ("secret-jwt", f"Bearer {JWT}", "Bearer [SECRET]"),
    ("secret-private-key", f"key:\n{PEM}\nend", "key:\n[SECRET]\nend"),
    # -- PII near misses: pass unchanged
    ("card-fails-luhn", "4111 1111 1111 1112", "4111 1111 1111 1112"),
    ("order-number", "order #1234567890123 shipped", "order #1234567890123 shipped"),
    ("dates", "on 2024-01-15 or 15/01/2024 at 10:30:45", "on 2024-01-15 or 15/01/2024 at 10:30:45"),
    ("version-string", "version 1.2.3.4 and v1.2.3.4", "version 1.2.3.4 and v1.2.3.4"),
    ("dotted-sequence", "section 1.2.3.4.5", "section 1.2.3.4.5"),
    ("ip-out-of-range", "256.1.1.1", "256.1.1.1"),
    ("ssn-invalid-areas", "000-12-3456 666-12-3456 900-12-3456", "000-12-3456 666-12-3456 900-12-3456"),
    ("iban-bad-check-digits", "DE89 3704 0044 0532 0130 02", "DE89 3704 0044 0532 0130 02"),
    ("phone-not-nanp", "id 123-456-7890", "id 123-456-7890"),
    ("plain-number", "population 5551234567", "population 5551234567"),
    ("word-like-sk-dash", "sk-learn-is-a-library-for-machine-learning", "sk-learn-is-a-library-for-machine-learning"),
    ("email-without-tld", "user@localhost", "user@localhost"),
    ("prices", "$1,234.56 or 3.14159", "$1,234.56 or 3.14159"),
    # -- streamed: PII split across chunks
    ("stream-email-2-chunks", ["write to bob@exam", "ple.com please"], "write to [EMAIL] please"),
    ("stream-card-3-chunks", ["card 4111 11", "11 1111 1", "111 ok"], "card [CARD] ok"),
    ("stream-phone-char-by-char", list("call +44 20 7946 0958 now"), "call [PHONE] now"),
    ("stream-iban-many-chunks", ["DE", "89 37", "04 00", "44 05", "32 01", "30 00", " done"], "[IBAN] done"),
    ("stream-fullwidth-card-chars", list("card ４１１１ １１１１ １１１１ １１１１!"), "card [CARD]!"),
    ("stream-word-split", ["we s", "k", "i there"], BLOCK),
]


def _bytes_chunks(text: str) -> list[bytes]:
    """``text`` as UTF-8, cut every 2 bytes: most multi-byte characters are split inside."""
    data = text.encode()
    return [data[i : i + 2] for i in range(0, len(data), 2)]


CASES.append(
    ("stream-bytes-split-inside-characters", _bytes_chunks("ｍａｉｌ ｂｏｂ＠ｅｘａｍｐｌｅ．ｃｏｍ ｎｏｗ"), "ｍａｉｌ [EMAIL] ｎｏｗ")
)


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 40
    assert len({name for name, _, _ in CASES}) == len(CASES)


@pytest.fixture
def guardrails(make_guardrails: Callable[..., Guardrails]) -> Guardrails:
    return make_guardrails(SPEC)


@pytest.mark.parametrize(("text", "expected"), [pytest.param(t, e, id=n) for n, t, e in CASES])
def test_case(guardrails: Guardrails, text: str | list[str] | list[bytes], expected: str) -> None:
    if isinstance(text, str):
        decision = guardrails.check_input([text])
        if expected == BLOCK:
            assert decision.blocked, decision.findings
            with pytest.raises(ContentFiltered) as caught:
                decision.raise_if_blocked()
            assert caught.value.status_code == 400 and caught.value.code == "content_filter"
            assert text not in caught.value.message
        else:
            assert not decision.blocked, decision.reasons
            assert decision.texts == (expected,)
            # A redacted text says so in its findings; an untouched one has none.
            assert bool(decision.findings) == (expected != text)
            assert all(f.action is Action.REDACT for f in decision.findings)
        return
    stream = guardrails.output_stream()
    sent: list[str] = []
    blocked = False
    for chunk in text:
        step = stream.feed(chunk)
        sent.append(step.text)
        if step.blocked:
            blocked = True
            break
    else:
        step = stream.flush()
        sent.append(step.text)
        blocked = step.blocked
    if expected == BLOCK:
        assert blocked
        assert "ski" not in "".join(sent)
    else:
        assert not blocked
        assert "".join(sent) == expected
