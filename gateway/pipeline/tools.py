"""Tool calling, the request side: OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and tool history.

Checked here (each refusal a 400 naming the parameter, ``tools[2].function.name``):
names match ``^[a-zA-Z0-9_-]{1,64}$`` and are unique; ``parameters`` is a JSON
Schema of an object that the grammar engine compiles within the grammar budget
(llguidance in a grammar worker, as for ``response_format``; checked before
planning, ``check_parameters``); at most ``MAX_TOOLS`` tools of at most
``MAX_PARAMETERS_BYTES`` of schema each (the route refuses larger ones earlier, by its
``gateway.pipeline.body``); a named ``tool_choice`` names one of them; a ``tool``
message answers a call an earlier assistant message made.

What the request then asks of the model (``ToolPlan``):

* ``none``: the model must not call. The tools are not rendered at all (rather
  than rendered and forbidden): a model told of tools writes calls, and with
  nothing allowed to become one they would reach the client as text; the
  prompt is shorter too. The history's calls and results are still rendered.
* ``auto`` (the default with tools): the model writes freely; its Hermes-style
  ``<tool_call>`` blocks and bare ``{"name", "arguments"}`` JSON become calls
  (``gateway.pipeline.tool_calls``), anything else is text.
* ``required`` and a named function: the output is decoded under a JSON
  Schema (``call_schema``): one ``{"name", "arguments"}`` object, or, where
  ``parallel_tool_calls`` is true and the choice is ``required``, an array of 1
  to ``MAX_PARALLEL_CALLS`` of them; each call's ``arguments`` valid against
  its function's ``parameters``. So the call always parses and validates.
  Unlike OpenAI, a forced answer is one call unless ``parallel_tool_calls`` is
  set to true: a small model given the array keeps adding calls until
  ``max_tokens`` cuts the JSON (SmolLM2 does, at temperature 0). And an object
  of the parameters that lists its ``properties`` and says nothing of
  ``additionalProperties`` takes only those properties in a forced call
  (``gateway.pipeline.json_schema``): a small model otherwise invents arguments for as
  long as it may. The answer is valid against the schema as the client gave it
  either way.

``response_format`` (or ``guided_*``) with ``auto`` decodes under that
constraint and parses no calls; with ``required`` or a named function it is
refused (two grammars cannot both hold).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inferflux.backends.engine import DEFAULT_BUDGET, GrammarBudget, GrammarTooComplexError, GuidedSpec
from inferflux.backends.engine.grammar_sandbox import shared_sandbox
from inferflux.backends.engine.guided import first_line
from inferflux.backends.models.tool_prompt import generic_tool_messages, template_uses_tools

from inferflux.gateway.errors import InvalidRequest, SchemaTooComplex
from inferflux.gateway.pipeline.json_numbers import bounded_numbers
from inferflux.gateway.pipeline.json_schema import closed_schema

if TYPE_CHECKING:
    from inferflux.backends.models.tokenizer import Tokenizer

MAX_TOOLS = 128
MAX_PARAMETERS_BYTES = 65536  # one function's parameters schema, as compact JSON
MAX_DESCRIPTION_CHARS = 16384
MAX_ARGUMENTS_DEPTH = 32  # nesting of a history call's arguments (as the body's own: input_limits.json_max_depth)
MAX_PARALLEL_CALLS = 8  # calls in one forced answer: the array's maxItems
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"

_CONFIG = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(BaseModel):
    model_config = _CONFIG

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # enforced whatever it says, when the call is forced


class ToolDefinition(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _CONFIG

    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = _CONFIG

    name: str = Field(pattern=NAME_PATTERN)
    arguments: str = Field(description="The arguments as JSON text (an object)")


class ToolCall(BaseModel):
    """A call in an assistant message of the history, as OpenAI returned it."""

    model_config = _CONFIG

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: CalledFunction

    def arguments_object(self) -> Any:
        """The arguments parsed; ValueError if they are not JSON (or nested beyond ``MAX_ARGUMENTS_DEPTH``)."""
        try:
            value = json.loads(self.function.arguments)
        except RecursionError:
            raise ValueError("nested too deeply") from None
        if _depth(value) > MAX_ARGUMENTS_DEPTH:
            raise ValueError("nested too deeply")
        return value


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


class ToolError(ValueError):
    """A refusal of the request's tools, naming the parameter (a 400 ``invalid_request_error``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the engine and of the output parser."""

    names: tuple[str, ...]  # the tools' names, in request order
    mode: Literal["auto", "forced"]  # forced: required or named, decoded under ``spec``
    parallel: bool
    spec: GuidedSpec | None = None  # forced only


def check_tools(tools: Sequence[ToolDefinition]) -> None:
    """Count, unique names and compilable parameter schemas; raises ``ToolError``."""
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools are allowed")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise ToolError(f"tools[{i}].function.name", f"the function name {name!r} is given twice")
        seen.add(name)
        if tool.function.parameters is not None:
            _check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")


def _check_parameters(schema: dict[str, Any], param: str) -> None:
    try:
        text = json.dumps(schema, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ToolError(param, f"parameters is not JSON: {exc}") from None
    if len(text.encode("utf-8", "surrogatepass")) > MAX_PARAMETERS_BYTES:
        raise ToolError(param, f"parameters may be at most {MAX_PARAMETERS_BYTES} bytes of JSON")
    kind = schema.get("type", "object")
    if kind != "object":
        raise ToolError(param, f"parameters must be the JSON Schema of an object (type 'object'), not {kind!r}")


def check_parameters(tools: Sequence[ToolDefinition], budget: GrammarBudget = DEFAULT_BUDGET,
                     cancel: threading.Event | None = None, owner: str | None = None) -> GrammarBudget:  # fmt: skip
    """Each tool's ``parameters`` compiles (llguidance, without a vocabulary: no model needed) within
    ``budget``, all of them together, in a grammar worker (``backends.engine.grammar_sandbox``, which
    remembers its verdicts: an application sends the same tools with every request). Returns what is
    left of ``budget``; raises ``InvalidRequest`` (a construct llguidance cannot enforce) or
    ``SchemaTooComplex`` (over the budget) naming the tool, and what the sandbox raises when busy or
    cancelled (``owner``: whose tools, to share the workers fairly). Blocking: the gateway runs it on a
    thread (``gateway.pipeline.grammars``)."""
    sandbox = shared_sandbox()
    for i, tool in enumerate(tools):
        if tool.function.parameters is None:
            continue
        param = f"tools[{i}].function.parameters"
        try:
            # As a forced call decodes it (call_schema): its numbers bounded.
            schema = bounded_numbers(_arguments_schema(tool.function.parameters))
            grammar = _parameters_grammar(json.dumps(schema, sort_keys=True, separators=(",", ":")))
            verdict = sandbox.check(grammar, None, budget, cancel, owner=owner)
        except GrammarTooComplexError as exc:  # (a ValueError too)
            raise SchemaTooComplex(f"parameters cannot be enforced: {exc}", param=param) from None
        except ValueError as exc:  # not an object schema, options that do not apply
            raise InvalidRequest(f"parameters cannot be enforced: {str(exc).splitlines()[0]}", param=param) from None
        if verdict.error:
            raise InvalidRequest(f"parameters cannot be enforced: {first_line(verdict.error)}", param=param)
        budget = budget.less(verdict)
    return budget


@lru_cache(maxsize=256)  # an application sends the same tools with every request
def _parameters_grammar(schema_json: str) -> str:
    """llguidance's grammar (its JSON form) of a parameters schema; ValueError where it cannot make one."""
    return GuidedSpec("json_schema", schema=json.loads(schema_json)).grammar()


def check_choice(tool_choice: ToolChoice | None, tools: Sequence[ToolDefinition] | None) -> None:
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if not tools:
        raise ToolError("tool_choice", "tool_choice 'required' or a named function needs tools")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in {t.function.name for t in tools}:
        raise ToolError("tool_choice.function.name", f"no tool is named {tool_choice.function.name!r}")


def check_history(messages: Sequence[Any]) -> None:
    """Each call's arguments are a JSON object; each ``tool`` message answers an earlier call."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        for j, call in enumerate(message.tool_calls or ()):
            try:
                arguments = call.arguments_object()
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments", "arguments must be a JSON object "
                                f"written as a string, nested at most {MAX_ARGUMENTS_DEPTH} deep")  # fmt: skip
            called.add(call.id)
        if message.role == "tool" and message.tool_call_id not in called:
            raise ToolError(f"messages[{i}].tool_call_id", "a tool message must answer a call of an earlier "
                            "assistant message (its tool_calls[].id)")  # fmt: skip


def tool_plan(tools: Sequence[ToolDefinition] | None, tool_choice: ToolChoice | None, parallel: bool | None,
              constrained: bool) -> ToolPlan | None:  # fmt: skip
    """What the tools ask for; None when the model may not call (no tools, ``none``, or auto under a constraint)."""
    if not tools or tool_choice == "none":
        return None
    names = tuple(t.function.name for t in tools)
    if tool_choice is None or tool_choice == "auto":
        return None if constrained else ToolPlan(names, "auto", parallel is not False)
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == tool_choice.function.name]
        return ToolPlan(names, "forced", False, GuidedSpec("json_schema", schema=call_schema(chosen, parallel=False)))
    many = parallel is True  # forced: one call unless asked for more (the module's docstring says why)
    return ToolPlan(names, "forced", many, GuidedSpec("json_schema", schema=call_schema(tools, parallel=many)))


def call_schema(tools: Sequence[ToolDefinition], *, parallel: bool) -> dict[str, Any]:
    """The JSON Schema a forced answer is decoded under: a call of one of ``tools`` (properties in the
    order name, arguments), or an array of 1 to ``MAX_PARALLEL_CALLS`` of them."""
    where = "#/items" if parallel else "#"
    calls = []
    for i, tool in enumerate(tools):
        at = f"{where}/anyOf/{i}" if len(tools) > 1 else where
        parameters = bounded_numbers(_arguments_schema(tool.function.parameters))
        arguments = _rebased(closed_schema(parameters), f"{at}/properties/arguments")
        calls.append({"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False})  # fmt: skip
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if not parallel:
        return one
    return {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    # No parameters: OpenAI's reading, a function of no arguments (any object is taken).
    if parameters is None:
        return {"type": "object"}
    return parameters if "type" in parameters else {**parameters, "type": "object"}


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local ``$ref``s (``#/$defs/x``) pointing below ``root``, where it is placed."""
    if isinstance(schema, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, root))
                for k, v in schema.items()}  # fmt: skip
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    return schema


# -- the prompt --------------------------------------------------------------------------------


def template_tools(tools: Sequence[ToolDefinition]) -> list[dict[str, Any]]:
    """The tools as transformers hands them to a template: OpenAI's objects, unset fields left out."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True, exclude={"strict"})}
            for t in tools]  # fmt: skip


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                has_tool_history: bool) -> str:  # fmt: skip
    """The chat prompt: tools and tool history through the template when it reads ``tools``, else the
    generic tool prompt (``backends.models.tool_prompt``)."""
    if tools is None and not has_tool_history:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if template_uses_tools(tokenizer.chat_template):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return tokenizer.apply_chat_template(generic_tool_messages(messages, tools), add_generation_prompt=True)


def template_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """History calls as templates read them: ``arguments`` an object, not JSON text."""
    return [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.arguments_object()}}
            for c in calls]  # fmt: skip


def call_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Call id -> function name, over the history's assistant messages (a template may want a tool message's name)."""
    return {c["id"]: c["function"]["name"] for m in messages for c in (m.get("tool_calls") or ())}

