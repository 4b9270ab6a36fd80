"""The README and docs/ hold together: every relative link leads somewhere, and the guides stay short.

A page that moves, a section that is renamed or a result file that is filed elsewhere leaves
links behind it that still look right in the Markdown. So every relative link and image of the
README, CONTRIBUTING.md and docs/*.md (outside code) must name a file or folder that exists, and
its ``#anchor``, where it has one and points at a Markdown page, a heading of that page (as GitHub
makes anchors from headings). The README is an entry, not a reference (at most 200 lines), and
docs/benchmarks.md holds the current figures, not a log of every run (at most 400 lines); every
run's JSON lives under benchmarks/results/, none beside the scripts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("docs/*.md")])
LINE_LIMITS = {ROOT / "README.md": 200, ROOT / "docs" / "benchmarks.md": 400}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target "title") and ![alt](target); the text may hold code spans, blanked before matching
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code."""
    found = []
    for number, line in prose_lines(text):
        bare = INLINE_CODE.sub(lambda code: "x" * len(code.group()), line)
        found += [(number, match.group(1)) for match in INLINE_LINK.finditer(bare)]
        found += [(number, match.group(1)) for match in REFERENCE_DEFINITION.finditer(bare)]
    return found


def anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, Markdown and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        heading = HEADING.match(line)
        if heading is None:
            continue
        anchor = anchor_of(heading.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        result.add(anchor if count == 0 else f"{anchor}-{count}")
    return result


def problems(document: Path, text: str) -> list[str]:
    """What in ``text`` (the content of ``document``) links to nothing."""
    wrong = []
    for number, target in links(text):
        if EXTERNAL.match(target):
            continue
        where = f"{document.relative_to(ROOT)}:{number}: {target}"
        path_part, _, anchor = target.partition("#")
        path_part = path_part.split("?")[0]
        resolved = (document.parent / path_part).resolve() if path_part else document
        if not resolved.exists():
            wrong.append(f"{where} (no such file)")
        elif ROOT not in resolved.parents and resolved != ROOT:
            wrong.append(f"{where} (outside the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            wrong.append(f"{where} (no heading of {resolved.relative_to(ROOT)} has this anchor)")
    return wrong


def test_the_pages_link_to_something() -> None:
    # The walk must have links to check: a change to the pattern that found none would pass.
    found = [target for page in DOCUMENTS for _, target in links(page.read_text(encoding="utf-8"))]
    assert len(found) >= 150
    assert any(target.startswith("../benchmarks/results/") for target in found)


def test_every_relative_link_leads_somewhere() -> None:
    wrong = [problem for page in DOCUMENTS for problem in problems(page, page.read_text(encoding="utf-8"))]
    assert not wrong, "links in the docs that lead nowhere:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "markdown",
    [
        "See [the API](api-that-moved.md).",
        "![a plot](img/no-such-plot.svg)",
        "Figures in [the page](benchmarks.md#a-section-that-was-renamed).",
        "[json](../benchmarks/results-2026-11-26-serving-exact-amd.json), where results were once filed",
        "[same page](#no-such-heading)",
        "[ref]: no-such-file.md",
    ],
)
def test_a_broken_link_is_caught(markdown: str) -> None:
    assert problems(ROOT / "docs" / "api.md", markdown)


@pytest.mark.parametrize(
    "markdown",
    [
        "`[not a link](nowhere.md)` in code",
        "```\n[not a link](nowhere.md)\n```",
        "[the web](https://example.com/nowhere.md)",
        "[tool calling](api.md#tool-calling-v1chatcompletions), [the engine](architecture.md#engine)",
    ],
)
def test_code_external_links_and_good_anchors_pass(markdown: str) -> None:
    assert not problems(ROOT / "docs" / "api.md", markdown)


@pytest.mark.parametrize("page", list(LINE_LIMITS), ids=lambda page: str(page.relative_to(ROOT)))
def test_the_guides_stay_short(page: Path) -> None:
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= LINE_LIMITS[page], f"{page.relative_to(ROOT)} has {lines} lines; at most {LINE_LIMITS[page]}"


def test_every_result_file_is_under_benchmarks_results() -> None:
    stray = sorted(path.name for path in (ROOT / "benchmarks").glob("*.json"))
    assert not stray, "result files beside the scripts (they go in benchmarks/results/): " + ", ".join(stray)
    assert list((ROOT / "benchmarks" / "results").glob("*.json"))
