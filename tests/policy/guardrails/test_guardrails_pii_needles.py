"""Each PII detector's precondition (``Detector.needed``) holds for every text it finds something in.

A detector is skipped, before any RE2 call, on a text where its precondition is
False; a precondition that were stricter than the detector would miss PII. So
every detector is run on samples of what it detects, and on random mixtures of
them, and its precondition must hold wherever it finds anything.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferflux.policy.guardrails import normalize, pii_email, pii_scan, pii_secrets
from inferflux.policy.guardrails.findings import Hit
from inferflux.policy.guardrails.pii import DETECTORS, Detector

JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ"
    ".SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)
GITHUB_BODY = "16C7e42F292c6912E7710c838347Ae178B4a"  # 36 characters

# What each finder must find something in (keyed by the finder's name: two detectors report "secret").
SAMPLES: dict[str, list[str]] = {
    "find_private_key": [
        "-----BEGIN PRIVATE KEY-----\nMIIEvQ\n-----END PRIVATE KEY-----",
        "key: -----BEGIN RSA PRIVATE KEY-----",
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn",
    ],
    "find_secret": [
        "key sk-proj-4f9XkQ2LmN8pR3sT6vW1yZ0aB",
        "sk-a1b2c3d4e5f6g7h8i9j0k1l2",
        "sk-svcacct-a1b2c3d4e5f6g7h8i9j0k1l2",
        *(f"token {kind}_{GITHUB_BODY}" for kind in ("ghp", "gho", "ghu", "ghs", "ghr")),
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnop",
        *(f"{prefix}IOSFODNN7EXAMPLE" for prefix in ("AKIA", "ASIA", "ABIA", "ACCA")),
        "xoxb-1234567890-abcdefghij",
        "xoxp-1234567890-abcdefghij",
        "AIza" + "SyA-1234567890" + "b" * 21,
        "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
        "rk_live_4eC39HqLyjWDarjtT1zdp7dc",
        "use ifx_abcdefghij27_" + "A1b2C3d4E5" * 4 + "xyz here",
        f"Bearer {JWT}",
    ],
    "find_card": ["4111 1111 1111 1111", "card 5500-0000-0000-0004.", "amex 378282246310005", "４１１１１１１１１１１１１１１１"],
    "find_iban": ["IBAN DE89 3704 0044 0532 0130 00, thanks", "GB82WEST12345698765432"],
    "find_ssn": ["ssn 123-45-6789", "ssn 123 45 6789."],
    "find_email": ["mail bob.smith+tag@example.co.uk now", "ＢＯＢ＠ＥＸＡＭＰＬＥ．ＣＯＭ", "bob\u200b@example.com"],
    "find_ip": ["host 192.168.1.20:8080", "addr 2001:db8::8a2e:370:7334 ok", "fe80::1", "::1"],
    "find_phone": ["call +44 20 7946 0958 today", "call +1-202-555-0173.", "(202) 555-0173", "202.555.0173",
                   "ruf +49 (0)30 1234567 an"],  # fmt: skip
}


def _detector(name: str) -> Detector:
    return next(d for d in DETECTORS if d.find.__name__ == name)


def test_every_detector_has_samples() -> None:
    assert {d.find.__name__ for d in DETECTORS} == set(SAMPLES)


@pytest.mark.parametrize(("name", "sample"), [(n, s) for n, samples in SAMPLES.items() for s in samples])
def test_the_precondition_holds_where_the_detector_finds_something(name: str, sample: str) -> None:
    detector = _detector(name)
    text = normalize(sample).text
    hits = list(detector.find(text))
    assert hits, "the sample must be something the detector finds"
    assert detector.needed(text)
    assert list(detector.search(text)) == hits


@pytest.mark.parametrize(("pattern", "needles"), pii_secrets._SECRET_SHAPES)
def test_every_secret_shape_is_sampled_and_its_matches_hold_a_needle(pattern: str, needles: tuple[str, ...]) -> None:
    shape = pii_scan.compile_re2(pattern)
    matches = [m.group() for s in SAMPLES["find_secret"] for m in shape.finditer(normalize(s).text)]
    assert matches, f"no sample of {pattern}"
    assert all(any(needle in match for needle in needles) for match in matches)
    assert set(needles) <= set(pii_secrets.SECRET_NEEDLES)


_PIECES = [s for samples in SAMPLES.values() for s in samples] + [
    " ", "  ", "\n", "-", "_", ".", ":", "@", "+", "(", ")", "x", "ab", "0", "7", "12", "2024", "sk", "gh", "eyj",
    "-----begin ", "private key-----", "-----end ", "٣", "２", "\u200b", "version ", "1.2.3.4", "de89", "ß",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=12).map("".join))
def test_skipping_never_changes_what_a_detector_finds(raw: str) -> None:
    text = normalize(raw).text
    for detector in DETECTORS:
        hits = list(detector.find(text))
        if hits:
            assert detector.needed(text), detector.find.__name__
        assert list(detector.search(text)) == hits


@pytest.mark.parametrize("digit", list("0123456789"))
def test_any_ascii_digit_lets_the_number_detectors_run(digit: str) -> None:
    for name in ("find_card", "find_iban", "find_ssn", "find_ip", "find_phone"):
        assert _detector(name).needed(f"x{digit}x"), name
    # ...and each digit alone can make a match: "7.7.7.7" is an address.
    address = ".".join([digit] * 4)
    assert list(_detector("find_ip").search(address)) == [Hit(0, 7, 7)]


def test_prose_skips_every_detector() -> None:
    def explode(_: str) -> list[Hit]:
        raise AssertionError("searched a text that cannot match")

    text = normalize("The weather today is sunny, with a light breeze from the west!").text
    for detector in DETECTORS:
        assert not detector.needed(text), detector.find.__name__
        assert list(detector._replace(find=explode).search(text)) == []


def test_re2_digits_are_ascii_only() -> None:
    # Why an ASCII digit is a precondition: other digits (Arabic-Indic here) survive normalisation
    # and RE2's \d does not match them.
    text = normalize("card ٤١١١ ١١١١ ١١١١ ١١١١, ssn ١٢٣-٤٥-٦٧٨٩").text
    assert pii_scan.compile_re2(r"\d").search(text) is None
    for detector in DETECTORS:
        assert list(detector.find(text)) == []
        assert list(detector.search(text)) == []


# -- e-mail addresses in ASCII text: found without RE2, exactly where RE2 finds them

EMAIL_ALPHABET = "ab9._%+-@ ,:\n"


def _re2_spans(text: str) -> list[tuple[int, int]]:
    """RE2's matches, less those whose local part is too long to report (find_email drops them)."""
    return [m.span() for m in pii_email._EMAIL.finditer(text) if text.index("@", m.start()) - m.start() <= pii_email.EMAIL_LOCAL_MAX]


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=EMAIL_ALPHABET, max_size=60))
def test_ascii_email_spans_are_re2s(text: str) -> None:
    assert list(pii_email._ascii_email_spans(text)) == _re2_spans(text)


@pytest.mark.parametrize("text", [
    "bob@example.com", "a@b.c", "a@b", "@example.com", "x@-y.com", "a@b..com", "a@b.com.", "a@b.com@c.org",
    "a@b@c.com", "a.@b.com", "..a@b.co", "mail bob.smith+tag@example.co.uk now", "a@b.com a@b.com",
    "x" * 64 + "@example.com", "x" * 65 + "@example.com", "y " + "x" * 200 + "@example.com and z@q.org",
    "x" * 70 + "@" + "a" * 300 + ".com then c@d.io", "a@" + "b." * 200 + "com",
])
def test_ascii_email_findings_are_re2s(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole findings too (find_email's checks after the search), on edge cases of both halves."""
    assert list(pii_email._ascii_email_spans(text)) == _re2_spans(text)
    fast = list(pii_email.find_email(text))
    monkeypatch.setattr(pii_email, "_email_spans", lambda t: (m.span() for m in pii_email._EMAIL.finditer(t)))
    assert fast == list(pii_email.find_email(text))


def test_non_ascii_text_still_goes_to_re2() -> None:
    """Unicode letters are e-mail characters too (\\pL): such a text is not read by the ASCII scanner."""
    assert [(h.start, h.end) for h in pii_email.find_email("écrire à josé@exemple.fr")] == [(9, 24)]
