"""The secret detectors (``policy.guardrails.pii``): API keys and tokens by their published shapes, and
PEM private key blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

from inferflux.policy.guardrails.findings import Hit
from inferflux.policy.guardrails.pii_scan import char_after, char_before, compile_re2, isolated

_TOKEN = r"[a-z0-9_-]"
# Each shape, with the literal text every match of it contains (one of them): a
# change to a pattern must keep its needles true (tests check them on samples).
_SECRET_SHAPES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (rf"sk-(?:proj-|svcacct-|admin-)?{_TOKEN}{{20,200}}", ("sk-",)),
    (r"gh[pousr]_[a-z0-9]{36,251}", ("ghp_", "gho_", "ghu_", "ghs_", "ghr_")),
    (r"github_pat_[a-z0-9_]{22,240}", ("github_pat_",)),
    (r"(?:akia|asia|abia|acca)[a-z0-9]{16}", ("akia", "asia", "abia", "acca")),
    (r"xox[abprs]-[a-z0-9-]{10,200}", ("xox",)),
    (rf"aiza{_TOKEN}{{35}}", ("aiza",)),
    (r"(?:sk|rk)_live_[a-z0-9]{16,200}", ("_live_",)),
    (r"ifx_[a-z2-7]{12}_[a-z0-9]{43}", ("ifx_",)),
    (rf"eyj{_TOKEN}{{8,1000}}\.eyj{_TOKEN}{{8,1000}}\.{_TOKEN}{{0,1000}}", ("eyj",)),
)
_SECRETS = compile_re2("|".join(pattern for pattern, _ in _SECRET_SHAPES))
SECRET_NEEDLES = tuple(needle for _, needles in _SECRET_SHAPES for needle in needles)
SECRET_MAX_LENGTH = 3 + 1000 + 4 + 1000 + 1 + 1000  # the longest shape above (a JWT)
_PEM_BEGIN = compile_re2(r"-----begin [a-z0-9 ]{0,40}private key-----")
_PEM_END = compile_re2(r"-----end [a-z0-9 ]{0,40}private key-----")
PEM_HEADER_MAX_LENGTH = 63


def find_secret(text: str) -> Iterator[Hit]:
    for m in _SECRETS.finditer(text):
        start, end = m.span()
        if not isolated(text, start, end) or char_before(text, start) == "-" or char_after(text, end) == "-":
            continue
        if m.group().startswith(("sk-", "xox")) and not any(ch.isdigit() for ch in m.group()):
            continue  # "sk-learn-and-friends" is a word, not a key
        yield Hit(start, end, end)


def find_private_key(text: str) -> Iterator[Hit]:
    for m in _PEM_BEGIN.finditer(text):
        start, header_end = m.span()
        closing = _PEM_END.search(text, header_end)
        if closing is None:
            yield Hit(start, len(text), header_end, closed=False)
        else:
            yield Hit(start, closing.end(), header_end)
