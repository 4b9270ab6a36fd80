"""The joined view: joiners (``-``, ``.``, ``_``, ``·``, dashes) between two letters read as nothing.

``blue-bird``, ``b_l_u_e_b_i_r_d`` and ``blue.bird`` match a blocked ``bluebird`` (they did not:
issue 44), while ``bird`` still matches in ``blue-bird`` (the skeleton keeps the words apart);
a finding covers the original span, joiners included; a stream decides as the whole text does.
The false-positive rate on benign English is in ``test_guardrails_false_positives.py`` (the
joined view is part of every check there).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferflux.policy.guardrails import Guardrails, parse_spec

normalize = importlib.import_module("inferflux.policy.guardrails.normalize")

BIRD = {"blocklist": [{"id": "bird", "literal": "bluebird"}]}


@pytest.mark.parametrize(
    "text",
    ["a blue-bird sang", "a blue.bird sang", "a blue_bird sang", "a b-l-u-e-b-i-r-d sang", "a b_l_u_e_b_i_r_d sang",
     "a b.l.u.e.b.i.r.d sang", "a blue--bird sang", "a blu-e_bi.rd sang", "a blue\u2014bird sang", "a blue\u2010bird",
     "a blue\u00b7bird", "BLUE-BIRD", "a ｂｌｕｅ－ｂｉｒｄ", "a blue*bird", "a blue/bird", "a blue|bird"],
)  # fmt: skip
def test_joiners_inside_a_word_are_read_through(make_guardrails: Callable[..., Guardrails], text: str) -> None:
    decision = make_guardrails(BIRD).check_input([text])
    assert decision.blocked, text
    [found] = decision.findings
    assert text[found.start:found.end].replace("\u2014", "-").lower().startswith(("b", "ｂ"))
    assert text[found.end - 1].lower() in "dｄ"


@pytest.mark.parametrize(
    "text",
    ["a blue----bird sang",  # more than three joiners: two words
     "a blue- bird sang", "a blue -bird", "blue - bird",  # a space: two words
     "a blue-birds' song", "a blue-bird2",  # the joined word is longer than the rule's
     "the blue 4-bird"],  # a digit never joins
)  # fmt: skip
def test_what_the_joined_view_does_not_join(make_guardrails: Callable[..., Guardrails], text: str) -> None:
    assert not make_guardrails(BIRD).check_input([text]).blocked, text


def test_each_part_of_a_joined_word_is_still_a_word(make_guardrails: Callable[..., Guardrails]) -> None:
    guards = make_guardrails({"blocklist": [{"id": "bird", "literal": "bird"}, {"id": "bb", "literal": "bluebird"}]})
    decision = guards.check_input(["a blue-bird"])
    assert sorted(f.rule for f in decision.findings) == ["blocklist.bb", "blocklist.bird"]


def test_a_redaction_covers_the_joiners(make_guardrails: Callable[..., Guardrails]) -> None:
    guards = make_guardrails({"blocklist": [{"id": "bird", "literal": "bluebird", "action": "redact"}]})
    assert guards.check_input(["a b_l_u_e-b.i.r.d, then blue-bird."]).texts == ("a [REDACTED], then [REDACTED].",)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab1 -._·*|\u1173é")), max_size=40))
def test_the_view_maps_back_to_the_skeleton(text: str) -> None:
    view = normalize.joined(text)
    if view is None:
        return
    assert len(view.text) < len(text)
    assert all(view.text[i] == text[view.position(i)] for i in range(len(view.text)))
    assert all(view.position(i) < view.position(i + 1) for i in range(len(view.text) - 1))


def _run(guards: Guardrails, chunks: list[str]) -> tuple[str, bool]:
    stream = guards.output_stream()
    sent = []
    for chunk in chunks:
        step = stream.feed(chunk)
        sent.append(step.text)
        if step.blocked:
            return "".join(sent), True
    step = stream.flush()
    return "".join(sent) + step.text, step.blocked


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_stream_decides_joined_words_as_the_whole_text(data: st.DataObject) -> None:
    guards = Guardrails([parse_spec({"blocklist": [{"id": "bird", "literal": "bluebird", "action": "redact"}]})])
    pieces = ["blue", "bird", "b", "l", "u", "e", "i", "r", "d", "-", "_", ".", "--", " ", "x", "·"]
    text = "".join(data.draw(st.lists(st.sampled_from(pieces), max_size=30)))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=8)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    assert _run(guards, chunks) == (guards.check_output(text).texts[0], False)
