"""The README and docs/ are true to the code: what they show an operator to type or paste works.

Documentation drifts from the code silently: a renamed subcommand or flag, a setting's
new rule, keeps the docs' examples looking right until an operator pastes one. So:

* every ``inferctl`` command line in the Markdown (fenced blocks, inline code, the first
  column of command tables) is walked along ``inferctl``'s own argparse tree, and every
  ``--option`` checked against the subcommand it ends on; they are not run, so
  placeholders (``<tenant-id>``, ``$KEY``) stand where values go. Every command must
  appear somewhere.
* every YAML block that is a server configuration, and the one in ``gateway.settings``'s
  docstring, loads through ``load_settings`` as a ``--config`` file would;
* the environment variables the settings docstring lists are the loader's, and every
  ``INFERFLUX_*`` variable the docs name is read somewhere in the code or the tests;
* every test a page cites as the evidence for a claim (the threat model's last column)
  exists;
* every API path the pages name (``/v1/...``, ``/admin/v1/...``) is a route, with the
  methods written before it (``GET /admin/v1/usage``, ``POST/GET /admin/v1/tenants``).
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from starlette.routing import BaseRoute, Match

from inferflux.gateway import settings as gateway_settings
from inferflux.gateway.cli import build_parser
from inferflux.gateway.cli.common import subcommands
from inferflux.gateway.cli.completion import leaves
from inferflux.gateway import websocket
from inferflux.gateway.routes import admin, health, openai
from inferflux.gateway.settings import load_settings
from inferflux.gateway.settings.loading import ENV_KEYS
from inferflux.gateway.settings.schema import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("docs/*.md")])
# Where a command line ends: a pipe, a list, a redirection, a comment, or prose after inline code.
SHELL_END = re.compile(r"\s(?:\||&&|;|>|<|2>|#)\s?")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
INVOCATION = re.compile(r"(?:^|[\s(/$])inferctl\s+(.*)")


@dataclass(frozen=True)
class Example:
    where: str  # file:line
    words: tuple[str, ...]  # after "inferctl"

    def __str__(self) -> str:
        return f"{self.where}: inferctl {' '.join(self.words)}"


def examples() -> list[Example]:
    found: list[Example] = []
    for path in DOCUMENTS:
        fenced = False
        lines = path.read_text(encoding="utf-8").splitlines()
        number = 0
        while number < len(lines):
            line, start = lines[number], number + 1
            number += 1
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                while line.endswith("\\") and number < len(lines):  # a command continued on the next line
                    line = line[:-1] + " " + lines[number].strip()
                    number += 1
                candidates = [line]
            else:
                candidates = INLINE_CODE.findall(line)
            for text in candidates:
                match = INVOCATION.search(text)
                if match is not None:
                    found.append(Example(f"{path.relative_to(ROOT)}:{start}", words_of(match.group(1))))
                elif not fenced and line.startswith("| `") and line.startswith(f"| `{text}`"):
                    # a command table's first column names commands without "inferctl": "| `keys list\\|create` |"
                    words = words_of(text.replace("\\|", "|"))
                    if words and words[0] in TOP_LEVEL:
                        found.append(Example(f"{path.relative_to(ROOT)}:{start}", words))
    return found


def words_of(command: str) -> tuple[str, ...]:
    command = SHELL_END.split(" " + command, maxsplit=1)[0].strip()
    try:
        return tuple(shlex.split(command))
    except ValueError:  # an unbalanced quote in an excerpt
        return tuple(command.split())


def problems(example: Example, root: argparse.ArgumentParser) -> list[str]:
    """What in ``example`` the parser does not know: an unknown subcommand or option."""
    parser, path, words = root, ["inferctl"], list(example.words)
    while words and not words[0].startswith("-"):
        choices = subcommands(parser)
        if not choices:
            break  # the rest are this command's values
        raw = words.pop(0)
        word = raw.rstrip("),.:;")
        if word != raw:  # prose goes on after the command: "(inferctl credentials), or ..."
            words = []
        if word.startswith(("<", "$", "{")) or word.isupper() or word in ("...", "…"):
            return []  # a placeholder for a command, as in "inferctl COMMAND --help"
        alternatives = word.split("|")  # a synopsis: "inferctl db upgrade|downgrade|current"
        missing = [name for name in alternatives if name not in choices]
        if missing:
            it_has = ", ".join(sorted(choices))
            return [f"{' '.join(path)} has no subcommand {name!r} (it has {it_has})" for name in missing]
        if words[:1] in (["..."], ["…"]):
            return []  # "inferctl admin models|limits ... --url URL": the words between are left out
        if len(alternatives) > 1:
            known = set.intersection(*(set(choices[name]._option_string_actions) for name in alternatives))
            return unknown_options(words, known, [*path, word])
        parser, path = choices[word], [*path, word]
    if path == ["inferctl"] and not example.words:
        return []
    return unknown_options(words, set(parser._option_string_actions), path)


def unknown_options(words: list[str], known: set[str], path: list[str]) -> list[str]:
    options = [word.rstrip("),.:;").split("=")[0] for word in words if word.startswith("-") and len(word) > 1]
    unknown = [option for option in options if option not in known and not option[1].isdigit()]  # "-1": a value
    return [f"{' '.join(path)} has no option {option!r}" for option in unknown]


def documented(example: Example, parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The commands ``example`` shows: one, or one per alternative of a synopsis ("list|create")."""
    choices = subcommands(parser)
    rest = example.words[len(path) :]
    if not choices or not rest:
        return {path} if not choices else set()
    names = rest[0].rstrip("),.:;").split("|")
    if not all(name in choices for name in names):
        return set()  # a placeholder or a mistake (the other test names it)
    return set().union(*(documented(example, choices[name], (*path, name)) for name in names))


TOP_LEVEL = frozenset(subcommands(build_parser()))
EXAMPLES = examples()


def test_the_docs_show_inferctl_commands() -> None:
    # The walk below must have something to check: a change to the Markdown's shape that hid every
    # example from the reader would otherwise pass.
    assert len(EXAMPLES) >= 50
    assert {example.words[0] for example in EXAMPLES if example.words} >= {"serve", "admin", "audit", "db"}


def test_every_documented_command_and_option_exists() -> None:
    root = build_parser()
    wrong = [f"{example}\n    -> {problem}" for example in EXAMPLES for problem in problems(example, root)]
    assert not wrong, "commands in the docs that inferctl does not know:\n" + "\n".join(wrong)


def test_every_inferctl_command_is_in_the_docs() -> None:
    # A command no page shows is a capability an operator cannot find: each must appear in the
    # README or docs/ (a synopsis such as "keys list|create|rotate|revoke" shows each of its words).
    root = build_parser()
    shown = {" ".join(path) for example in EXAMPLES for path in documented(example, root)}
    missing = sorted(set(leaves(root)) - shown)
    assert not missing, "inferctl commands no page of the docs shows: " + ", ".join(missing)


@pytest.mark.parametrize(
    "words",
    [
        ("serve", "--no-such-flag"),
        ("admin", "tenants-that-are-not"),
        ("audit", "verify", "--spoool", "x"),
        ("db", "upgrade|downgrade|currant"),
        ("idps", "list|create", "--urll", "U"),
    ],
)
def test_a_renamed_command_or_option_is_caught(words: tuple[str, ...]) -> None:
    assert problems(Example("here:1", words), build_parser())


def config_examples() -> list[tuple[str, str]]:
    """(where, YAML) of each fenced YAML block that is a server configuration, and the docstring's."""
    found = []
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"```ya?ml\n(.*?)```", text, re.S):
            data = yaml.safe_load(match.group(1))
            if isinstance(data, dict) and set(data) & set(Settings.model_fields):  # not a Kubernetes probe, say
                found.append((f"{path.relative_to(ROOT)}:{text[: match.start()].count(chr(10)) + 1}", match.group(1)))
    found.append(("gateway/settings/__init__.py (docstring)", docstring_block("::")))
    return found


def docstring_block(after: str) -> str:
    """The indented block that follows the line ending with ``after`` in ``gateway.settings``'s docstring."""
    lines = (gateway_settings.__doc__ or "").split(after + "\n", 1)[1].splitlines()
    block = []
    for line in lines:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).strip("\n")


@pytest.mark.parametrize("text", [pytest.param(text, id=where) for where, text in config_examples()])
def test_every_configuration_example_loads(text: str, tmp_path: Path) -> None:
    config = tmp_path / "inferflux.yaml"
    config.write_text(text, encoding="utf-8")
    load_settings(config, env={})  # a ConfigError names the key and what is wrong with it


def test_the_docs_show_whole_configurations() -> None:
    assert len(config_examples()) >= 5


def test_the_settings_docstring_lists_the_loaders_environment_variables() -> None:
    table = docstring_block("Environment variables (each sets the key beside it):")
    listed = dict(line.split(None, 1) for line in table.splitlines())
    assert set(listed) - {"INFERFLUX_CONFIG"} == set(ENV_KEYS)
    for variable, key in ENV_KEYS.items():
        if key.split(".")[0] in Settings.model_fields:  # "model" and "model_name" are the loader's own, told in words
            assert listed[variable].split()[0] == key, variable


def test_every_environment_variable_the_docs_name_is_read() -> None:
    code = "\n".join(
        path.read_text(encoding="utf-8", errors="replace")
        for folder in ("gateway", "backends", "policy", "kernels", "benchmarks", "tests", "deploy")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".sh", ".toml", ".yaml"} or path.name in {"Dockerfile", "Makefile"}
        if path != Path(__file__).resolve()
    ) + (ROOT / "Makefile").read_text(encoding="utf-8")
    variable_name = re.compile(r"INFERFLUX_[A-Z0-9_]*[A-Z0-9]_?")  # a trailing _: a prefix (INFERFLUX_UPSTREAM_)
    named = {variable for path in DOCUMENTS for variable in variable_name.findall(path.read_text(encoding="utf-8"))}
    assert named, "the docs name no INFERFLUX_ variable: the search above found nothing to check"
    unread = sorted(variable for variable in named if not re.search(rf"\b{variable}\b", code))
    assert not unread, "variables the docs name that nothing reads: " + ", ".join(unread)


def test_every_test_the_docs_cite_exists() -> None:
    # The threat model (docs/security.md) and other pages name the test that covers each claim
    # ("gateway/test_x.py::test_y", then "::test_z" in the same file) or the module that does:
    # a renamed test leaves the claim uncovered without a word.
    cited: list[tuple[str, Path, str | None]] = []  # (where, file, test or None for the module)
    for path in DOCUMENTS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where, current = f"{path.relative_to(ROOT)}:{number}", None
            for code in INLINE_CODE.findall(line):
                for match in re.finditer(r"((?:[\w.-]+/)*test_\w+\.py)?(?:::(test_\w+))?", code):
                    module, test = match.groups()
                    if module:
                        current = cited_module(module)
                    if current is not None and (module or test):
                        cited.append((where, current, test))
    functions = sum(test is not None for _, _, test in cited)
    assert functions >= 60, "the pattern found too few citations to be checking anything"
    missing = []
    for where, file, test in cited:
        if not file.is_file():
            missing.append(f"{where}: {file.relative_to(ROOT)}")
        elif test and not re.search(rf"^(?:async )?def {test}\(", file.read_text(encoding="utf-8"), re.M):
            missing.append(f"{where}: {file.relative_to(ROOT)}::{test}")
    assert not missing, "tests the docs cite that do not exist:\n" + "\n".join(sorted(set(missing)))


def cited_module(cited: str) -> Path:
    """The file a citation names: under tests/ (its path given from there or from the root), or by
    its bare name where the page's context gives the folder ("`test_local.py` runs ...")."""
    if "/" not in cited:
        found = sorted((ROOT / "tests").rglob(cited))
        return found[0] if len(found) == 1 else ROOT / "tests" / cited
    return ROOT / cited if cited.startswith("tests/") else ROOT / "tests" / cited


# A path of the tenant or the admin API, with the methods written before it, if any
# ("GET /admin/v1/usage", "POST/GET `/admin/v1/tenants/{id}/policies`").
API_PATH = re.compile(r"(?:\b((?:GET|POST|PUT|PATCH|DELETE)(?:/(?:GET|POST|PUT|PATCH|DELETE))*)\s+`?)?"
                      r"(/(?:admin/)?v1(?:/[\w.{}<>:-]+)+)")  # fmt: skip
PLACEHOLDER = re.compile(r"\{[^}/]*\}|<[^>/]*>")
# Paths the pages name that are not this gateway's: the OTLP collector's endpoint.
FOREIGN_PATHS = {"/v1/traces"}


def api_paths() -> list[tuple[str, str, list[str]]]:
    """(where, path, methods) for every API path the pages name; generic ones (``/admin/v1/<path>``) left out."""
    found = []
    for path in DOCUMENTS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in API_PATH.finditer(line):
                methods, named = match.group(1), match.group(2).rstrip(".:")
                if named in FOREIGN_PATHS or "<path>" in named:
                    continue
                found.append((f"{path.relative_to(ROOT)}:{number}", named, methods.split("/") if methods else []))
    return found


def api_routes() -> list[BaseRoute]:
    """The routes of the tenant API, the admin API, the probes and the WebSocket (the app adds /metrics and
    /openapi.json)."""
    return [*openai.routes(), *admin.routes(), *health.routes(), *websocket.routes()]


def unrouted(named: str, methods: list[str], routes: list[BaseRoute]) -> list[str]:
    """What of ``methods`` on ``named`` no route takes (``[""]``: not the path with any method)."""
    concrete = PLACEHOLDER.sub("x1", named)

    def best(method: str) -> Match:
        scopes = [{"type": "http", "path": concrete, "root_path": "", "method": method}]
        if method == "GET":  # a WebSocket's handshake is a GET
            scopes.append({"type": "websocket", "path": concrete, "root_path": ""})
        return max((route.matches(scope)[0] for route in routes for scope in scopes), key=lambda m: m.value,
                   default=Match.NONE)  # fmt: skip

    if not methods:
        return [] if best("GET") is not Match.NONE else [""]
    return [method for method in methods if best(method) is not Match.FULL]


def test_every_api_path_the_docs_name_is_a_route() -> None:
    routes = api_routes()
    named = api_paths()
    assert len(named) >= 40, "the pattern found too few paths to be checking anything"
    wrong = [f"{where}: {' '.join(missing + [path]).strip()}"
             for where, path, methods in named if (missing := unrouted(path, methods, routes))]
    assert not wrong, "API paths or methods the docs name that no route takes:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("path", "methods"),
    [("/admin/v1/tenant/x1/keys", []), ("/admin/v1/usage", ["DELETE"]), ("/v1/completion", ["POST"]),
     ("/v1/websocket", ["POST"]), ("/v1/websockets", [])],
)
def test_a_wrong_api_path_or_method_is_caught(path: str, methods: list[str]) -> None:
    routes = api_routes()
    assert unrouted(path, methods, routes)
