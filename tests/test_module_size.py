"""No module over 400 lines and no function over 60 in gateway/, policy/, backends/ and kernels/, unless it says why.

A module is read top to bottom, and a function at a glance: past these sizes
one usually holds two things that want a module or a function each. When one
thing is that long (a table, a kernel that must be one function), it says so:

* a module over ``MAX_MODULE_LINES`` carries a line starting ``Size:`` in its
  docstring or in its first comment block, giving the reason;
* a function over ``MAX_FUNCTION_LINES`` (from its ``def`` to its last line,
  methods and nested functions included) has a comment starting ``# Long:``
  in the comment lines directly above its ``def``, or above its first
  decorator when it has one.

Every ``.py`` file is parsed with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "policy", "backends", "kernels")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MODULE_REASON = "Size:"
FUNCTION_REASON = "# Long:"


@dataclass(frozen=True)
class Oversize:
    path: str
    line: int
    what: str  # "module", or "function <name>"
    lines: int

    def __str__(self) -> str:
        limit = MAX_MODULE_LINES if self.what == "module" else MAX_FUNCTION_LINES
        reason = MODULE_REASON if self.what == "module" else FUNCTION_REASON
        return f"{self.path}:{self.line}: {self.what} is {self.lines} lines (over {limit}, no '{reason}' reason)"


def _first_comment_block(lines: list[str]) -> list[str]:
    """The first run of consecutive comment lines at the module's top level (a ``#!`` line is not one)."""
    block: list[str] = []
    for line in lines:
        if line.startswith("#") and not line.startswith("#!"):
            block.append(line)
        elif block:
            break
    return block


def _module_has_reason(tree: ast.Module, lines: list[str]) -> bool:
    docstring = ast.get_docstring(tree, clean=True) or ""
    texts = docstring.splitlines() + [line.lstrip("#") for line in _first_comment_block(lines)]
    return any(text.strip().startswith(MODULE_REASON) for text in texts)


def _comments_above(lines: list[str], line: int) -> list[str]:
    """The consecutive comment lines directly above 1-based ``line``, nearest last."""
    above: list[str] = []
    index = line - 2
    while index >= 0 and lines[index].strip().startswith("#"):
        above.insert(0, lines[index].strip())
        index -= 1
    return above


def _function_has_reason(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
    return any(comment.startswith(FUNCTION_REASON) for comment in _comments_above(lines, first))


def oversized(path: str, text: str) -> list[Oversize]:
    """What in module ``text`` (file ``path``) is over its limit without a stated reason."""
    lines = text.splitlines()
    tree = ast.parse(text, filename=path)
    found = []
    if len(lines) > MAX_MODULE_LINES and not _module_has_reason(tree, lines):
        found.append(Oversize(path, 1, "module", len(lines)))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not _function_has_reason(node, lines):
                found.append(Oversize(path, node.lineno, f"function {node.name}", length))
    return found


def _sources() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def test_no_module_or_function_is_oversized_without_a_reason() -> None:
    assert _sources(), "no sources found: the test reads nothing"
    found = [
        problem
        for path in _sources()
        for problem in oversized(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
    ]
    assert not found, "split these, or say why they are this long:\n" + "\n".join(map(str, found))


# -- the rule itself, on synthetic modules


def _module(body_lines: int, docstring: str = "A module.") -> str:
    """A module of exactly ``body_lines + 2`` lines: its docstring, a blank line, then assignments."""
    return f'"""{docstring}"""\n\n' + "".join(f"x{i} = {i}\n" for i in range(body_lines))


def _function(length: int, above: str = "", decorator: str = "") -> str:
    """A module holding one function of exactly ``length`` lines (``def`` included)."""
    body = "".join(f"    y{i} = {i}\n" for i in range(length - 1))
    return f'"""A module."""\n\n{above}{decorator}def f() -> None:\n{body}'


def test_a_module_at_the_limit_passes_and_one_line_more_is_flagged() -> None:
    assert oversized("m.py", _module(MAX_MODULE_LINES - 2)) == []
    assert oversized("m.py", _module(MAX_MODULE_LINES - 1)) == [Oversize("m.py", 1, "module", MAX_MODULE_LINES + 1)]


@pytest.mark.parametrize("docstring", ["A table.\n\nSize: one row per country, in one place.", "Size: a table."])
def test_a_size_line_in_the_docstring_states_the_reason(docstring: str) -> None:
    assert oversized("m.py", _module(MAX_MODULE_LINES, docstring)) == []


def test_a_size_line_in_the_first_comment_states_the_reason() -> None:
    text = "#!/usr/bin/env python\n# A generated table.\n# Size: generated from the spec, one entry a line.\n"
    text += "".join(f"x{i} = {i}\n" for i in range(MAX_MODULE_LINES))
    assert oversized("m.py", text) == []
    assert oversized("m.py", text.replace("# Size:", "# Sizes:")) != []


def test_size_must_start_a_line() -> None:
    assert oversized("m.py", _module(MAX_MODULE_LINES, "A table; Size: mentioned in passing.")) != []


def test_a_function_at_the_limit_passes_and_one_line_more_is_flagged() -> None:
    assert oversized("m.py", _function(MAX_FUNCTION_LINES)) == []
    assert oversized("m.py", _function(MAX_FUNCTION_LINES + 1)) == [
        Oversize("m.py", 3, "function f", MAX_FUNCTION_LINES + 1)
    ]


@pytest.mark.parametrize(
    ("above", "decorator"),
    [
        ("# Long: one state machine, its states read in order.\n", ""),
        ("# Long: a kernel is one function;\n# splitting it costs registers.\n", ""),
        ("# The kernel.\n# Long: a kernel is one function.\n", ""),
        ("# Long: a kernel is one function.\n", "@staticmethod\n@property\n"),
    ],
)
def test_a_long_comment_directly_above_states_the_reason(above: str, decorator: str) -> None:
    assert oversized("m.py", _function(MAX_FUNCTION_LINES + 1, above, decorator)) == []


@pytest.mark.parametrize(
    ("above", "decorator"),
    [
        ("# Long: not directly above.\n\n", ""),  # a blank line between
        ("", "# Long: between the decorator and the def.\n"),  # the comment must go above the decorators
        ("# long: the wrong spelling.\n", ""),
        ("x = 1  # Long: a trailing comment is not one above.\n", ""),
    ],
)
def test_a_long_comment_elsewhere_does_not(above: str, decorator: str) -> None:
    decorator = decorator and ("@staticmethod\n" + decorator)
    assert oversized("m.py", _function(MAX_FUNCTION_LINES + 1, above, decorator)) != []


def test_methods_and_nested_functions_are_measured_too() -> None:
    inner = "".join(f"            z{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    text = f'"""A module."""\n\n\nclass C:\n    def outer(self) -> None:\n        def inner() -> None:\n{inner}'
    assert [problem.what for problem in oversized("m.py", text)] == ["function outer", "function inner"]
