"""docs/architecture.md's "A chat completion's path" names what the code has, and all the driver enters.

The section is a table, one row per function body a chat completion enters: its module
(a file of the repository) and its function (``name`` at the module's top level, or
``Class.method``). The source is read with ``ast``, nothing imported. A stage moved or
renamed without the page fails here; so does a path that grows past what a newcomer reads
it in (issue 46: at most 12 bodies beside the policy's steps, in at most 11 modules, each
module named at most twice), a policy row that is not a step of ``RequestPolicy``'s
refusal order or comes out of that order, and a function the driver enters that the
table leaves out: every function of ``gateway/pipeline/run.py`` that ``generate`` reaches,
every project function they call, and every ``RequestPolicy`` method they call.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
HEADING = "## A chat completion's path"
DRIVER = "gateway/pipeline/run.py"
ENTRY = "generate"  # the chat route's one line calls it
POLICY = "gateway/pipeline/policy.py"
POLICY_CLASS = "RequestPolicy"
POLICY_VARIABLE = "policy"  # what the driver calls its RequestPolicy
MAX_BODIES = 12  # the rows beside the policy's steps (issue 46)
MAX_MODULES = 11  # the modules they and the policy's steps are in
MAX_ENTRIES = 2  # the rows any module but the policy's may have

ROW = re.compile(r"^\|(?P<stage>[^|]+)\|\s*`(?P<module>[^`]+)`\s*\|\s*`(?P<function>[^`]+)`\s*\|\s*$")
STEP_LABEL = re.compile(r"^policy (?P<step>\d[a-z]?)\b")
# RequestPolicy's docstring numbers its steps "1. ..." and their parts "   a. ...".
STEP = re.compile(r"^(?P<number>\d)\. ")
PART = re.compile(r"^\s+(?P<letter>[a-z])\. ")

Row = tuple[str, str, str]  # (stage, module, function)


def path_rows(text: str) -> list[Row]:
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


def is_policy(row: Row) -> bool:
    return row[1] == POLICY and row[2].startswith(f"{POLICY_CLASS}.")


# -- what the driver enters, read from its source


def module_path(dotted: str) -> str | None:
    """``inferflux.gateway.pipeline.body`` -> ``gateway/pipeline/body.py`` (a package's ``__init__.py``)."""
    parts = dotted.split(".")
    if parts[0] != "inferflux":
        return None
    base = ROOT.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(ROOT).as_posix()
    return None


def project_imports(tree: ast.Module) -> dict[str, str]:
    """Each name imported from a project module at the top of ``tree`` -> that module's file."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and (path := module_path(node.module)):
            names.update({alias.asname or alias.name: path for alias in node.names})
    return names


def classes_of(path: str) -> set[str]:
    return {n.name for n in ast.parse((ROOT / path).read_text()).body if isinstance(n, ast.ClassDef)}


def reachable(tree: ast.Module, entry: str) -> list[ast.AsyncFunctionDef | ast.FunctionDef]:
    """The module's top-level functions ``entry`` reaches by calling them by name, ``entry`` first."""
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    seen, todo = [entry], [entry]
    while todo:
        for node in ast.walk(functions[todo.pop()]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name = node.func.id
                if name in functions and name not in seen:
                    seen.append(name)
                    todo.append(name)
    return [functions[name] for name in seen]


def entered(source: str, path: str = DRIVER, entry: str = ENTRY) -> set[tuple[str, str]]:
    """(module, function) of every body the driver's ``entry`` enters: the driver's own functions it reaches,
    the project functions they call (``f`` or ``Class.method``; a class called is a constructor, not a row),
    and the ``RequestPolicy`` methods they call on ``policy``."""
    tree = ast.parse(source)
    imported = project_imports(tree)
    found = set()
    for function in reachable(tree, entry):
        found.add((path, function.name))
        for node in ast.walk(function):
            if not isinstance(node, ast.Call):
                continue
            called = node.func
            if isinstance(called, ast.Name) and called.id in imported:
                if called.id not in classes_of(imported[called.id]):
                    found.add((imported[called.id], called.id))
            elif isinstance(called, ast.Attribute) and isinstance(called.value, ast.Name):
                owner = called.value.id
                if owner == POLICY_VARIABLE:
                    found.add((POLICY, f"{POLICY_CLASS}.{called.attr}"))
                elif owner in imported and owner in classes_of(imported[owner]):
                    found.add((imported[owner], f"{owner}.{called.attr}"))
    return found


# -- RequestPolicy's refusal order


def policy_steps(docstring: str) -> dict[str, str]:
    """Each step of the refusal order (``1``, ``3a``, ...) -> its text; a step's text holds its parts'."""
    steps: dict[str, str] = {}
    number = part = None
    for line in docstring.splitlines():
        if m := STEP.match(line):
            number, part = m["number"], None
        elif number is not None and (m := PART.match(line)):
            part = m["letter"]
        elif number is not None and not line.startswith(" ") and line.strip():
            number = part = None  # the list is over
        if number is None:
            continue
        steps[number] = steps.get(number, "") + line + "\n"
        if part is not None:
            steps[number + part] = steps.get(number + part, "") + line + "\n"
    return steps


def refusal_order() -> dict[str, str]:
    """The steps of ``RequestPolicy``'s refusal order (its module's docstring holds it)."""
    return policy_steps(ast.get_docstring(ast.parse((ROOT / POLICY).read_text())) or "")


# -- the tests


def test_the_section_has_a_row_per_stage() -> None:
    rows = path_rows(PAGE.read_text())
    assert len(rows) >= 10, f"{HEADING!r} in docs/architecture.md has {len(rows)} rows; its table did not parse"
    assert rows[0][1] == "gateway/routes/openai.py" and rows[1][1] == DRIVER, rows[:2]


def test_each_named_module_holds_the_named_function() -> None:
    missing = []
    for stage, module, function in path_rows(PAGE.read_text()):
        source = ROOT / module
        if not source.is_file():
            missing.append(f"{stage}: {module} does not exist")
        elif not defines(ast.parse(source.read_text()), function):
            missing.append(f"{stage}: {module} defines no {function}")
    assert not missing, "docs/architecture.md's path names what the code lacks:\n" + "\n".join(missing)


def test_the_path_stays_within_its_bodies_and_modules() -> None:
    rows = path_rows(PAGE.read_text())
    bodies = [row for row in rows if not is_policy(row)]
    assert len(bodies) <= MAX_BODIES, f"{len(bodies)} bodies beside the policy's steps: {bodies}"
    modules = {module for _, module, _ in rows}
    assert len(modules) <= MAX_MODULES, sorted(modules)
    entries = Counter(module for _, module, _ in bodies)
    assert all(n <= MAX_ENTRIES for n in entries.values()), {m: n for m, n in entries.items() if n > MAX_ENTRIES}


def test_the_policy_rows_are_its_steps_in_their_order() -> None:
    steps = refusal_order()
    assert {"1", "2", "3", "3a", "3b", "3c", "4"} <= set(steps), f"the refusal order did not parse: {sorted(steps)}"
    order = []
    for stage, _, function in filter(is_policy, path_rows(PAGE.read_text())):
        label = STEP_LABEL.match(stage)
        assert label is not None, f"the row of {function} names no step ('policy <n>'): {stage!r}"
        step, method = label["step"], function.split(".", 1)[1]
        assert step in steps, f"{function}: RequestPolicy's docstring has no step {step}"
        assert f"``{method}``" in steps[step], f"{function}: step {step} of RequestPolicy's docstring does not name it"
        order.append(int(step[0]))
    assert order == sorted(order), f"the policy's rows are out of the refusal order: {order}"


def test_every_body_the_driver_enters_is_a_row() -> None:
    rows = {(module, function) for _, module, function in path_rows(PAGE.read_text())}
    missing = entered((ROOT / DRIVER).read_text()) - rows
    assert not missing, f"docs/architecture.md's path leaves out what the driver enters: {sorted(missing)}"


def test_a_row_naming_what_is_not_there_fails() -> None:
    tree = ast.parse("class Call:\n    def of(cls): ...\n\nasync def read_body(call): ...\n")
    assert defines(tree, "Call.of") and defines(tree, "read_body")
    assert not defines(tree, "Call.model") and not defines(tree, "read_json") and not defines(tree, "Body.of")


def test_a_driver_hiding_a_helper_or_a_step_is_caught() -> None:
    source = (
        "from inferflux.gateway.pipeline.body import read_body\n"
        "from inferflux.gateway.pipeline.call import Call\n"
        "from inferflux.gateway.pipeline.policy import RequestPolicy\n\n"
        "async def generate(request):\n"
        "    call = Call.of(request)\n"
        "    policy = RequestPolicy(call, call.state.traffic)\n"
        "    return await _helper(call, policy, await read_body(call))\n\n"
        "async def _helper(call, policy, body):\n"
        "    return await policy.screen(body)\n\n"
        "async def embeddings(request): ...\n"
    )
    assert entered(source) == {
        (DRIVER, "generate"),
        (DRIVER, "_helper"),
        ("gateway/pipeline/call.py", "Call.of"),
        ("gateway/pipeline/body.py", "read_body"),
        (POLICY, "RequestPolicy.screen"),
    }


def test_the_steps_are_read_with_their_parts() -> None:
    steps = policy_steps("Intro.\n\n1. ``screen``: one.\n3. in order:\n   a. ``admit``\n   b. ``other``\n"
                         "   A refused one: ``refund``.\n4. ``finish``\n\nAfter the list.\n")  # fmt: skip
    assert "``admit``" in steps["3a"] and "``admit``" not in steps["3b"] and "``refund``" in steps["3"]
    assert "After" not in steps["4"] and set(steps) == {"1", "3", "3a", "3b", "4"}
