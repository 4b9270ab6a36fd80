"""docs/architecture.md's "A chat completion's path" names what the code has: each module exists and holds the function.

The section is a table, one row per stage: its module (a file of the repository) and
its function (``name`` at the module's top level, or ``Class.method``). The source is
read with ``ast``, nothing imported. A stage moved or renamed without the page fails
here, and so does a path that grows past the modules a newcomer reads it in.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
HEADING = "## A chat completion's path"
MAX_MODULES = 11  # the modules one meets reading a chat completion from its route (issue 46)

ROW = re.compile(r"^\|(?P<stage>[^|]+)\|\s*`(?P<module>[^`]+)`\s*\|\s*`(?P<function>[^`]+)`\s*\|\s*$")


def path_rows(text: str) -> list[tuple[str, str, str]]:
    """(stage, module, function) of each row of the section's table."""
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    section = text[start : end if end != -1 else len(text)]
    return [(m["stage"].strip(), m["module"], m["function"]) for m in map(ROW.match, section.splitlines()) if m]


def defines(tree: ast.Module, function: str) -> bool:
    """Whether ``function`` (``name`` or ``Class.method``) is defined at the top level of ``tree``."""
    scope: list[ast.stmt] = tree.body
    *owners, name = function.split(".")
    for owner in owners:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner]
        if not found:
            return False
        scope = found[0].body
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name for n in scope)


def test_the_section_has_a_row_per_stage() -> None:
    rows = path_rows(PAGE.read_text())
    assert len(rows) >= 10, f"{HEADING!r} in docs/architecture.md has {len(rows)} rows; its table did not parse"
    assert rows[0][1] == "gateway/routes/openai.py" and rows[1][1] == "gateway/pipeline/run.py", rows[:2]


def test_each_named_module_holds_the_named_function() -> None:
    missing = []
    for stage, module, function in path_rows(PAGE.read_text()):
        source = ROOT / module
        if not source.is_file():
            missing.append(f"{stage}: {module} does not exist")
        elif not defines(ast.parse(source.read_text()), function):
            missing.append(f"{stage}: {module} defines no {function}")
    assert not missing, "docs/architecture.md's path names what the code lacks:\n" + "\n".join(missing)


def test_the_path_stays_within_its_modules() -> None:
    modules = {module for _, module, _ in path_rows(PAGE.read_text())}
    assert len(modules) <= MAX_MODULES, sorted(modules)


def test_a_row_naming_what_is_not_there_fails() -> None:
    tree = ast.parse("class Call:\n    def of(cls): ...\n\nasync def read_body(call): ...\n")
    assert defines(tree, "Call.of") and defines(tree, "read_body")
    assert not defines(tree, "Call.model") and not defines(tree, "read_json") and not defines(tree, "Body.of")
