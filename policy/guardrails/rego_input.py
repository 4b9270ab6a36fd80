"""A policy's input document, built value by value through rego-cpp's C API instead of parsed from JSON.

rego-cpp turns JSON input text into its term representation with its whole
parsing pipeline, about 10 µs per value: most of an embedded decision's cost
(a request's document has 30-40 values), and CPU-cache hungry, so it costs
two to three times as much again when it runs between other work. The C API
can also build the same term directly (``regoNewInput``, ``regoInputString``,
...); a request's document then takes well under 0.1 ms, and what is left for
the evaluating thread is the query itself.

The builder calls go through ``ctypes.PyDLL``, which keeps the GIL: each call
is a small allocation, and releasing the GIL around it (as ``ctypes.CDLL`` and
``regopy.Input`` do) would cost more than the call and, on a busy gateway,
queue every one of the dozens of calls behind whichever thread holds the GIL.
So a document is built on the event loop as plain Python work, and handed to
an evaluating thread ready to use.

rego-cpp keeps a string in its escaped source form and compares those forms,
so strings go in JSON-escaped with non-ASCII characters kept as they are,
exactly as the same string written in a policy is stored (``"Zürich"`` then
equals ``input.tenant.name``; ``\\u00fc`` would not).

An interpreter keeps pointing into the input it was given: the returned
``Term`` frees the term when it is dropped, so whoever sets it must hold it
until the interpreter has a new one.

The query (``query``) is bound the same way, except for the evaluation
itself. Through ``regopy`` a decision is some twenty ``ctypes.CDLL`` calls
(set the input, query, then walk the output node by node), each releasing
the GIL and taking it back; on a busy two-core gateway each take-back waits
behind the event loop and the engine thread, and the queueing added up past
a policy's 100 ms timeout (the "convoy effect"). Here only the evaluation
releases the GIL (``CDLL``): the evaluating thread takes it back once, reads
the output as one JSON text and parses it in Python.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from inferflux.policy.bounded import remember

_INT64 = (-(2**63), 2**63 - 1)
# What json.dumps(ensure_ascii=False) escapes: the quote, the backslash and control characters.
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')
MAX_DEPTH = 32


class _Api:
    """The C API's input builder, bound through ``ctypes.PyDLL`` (no GIL release)."""

    def __init__(self, library: str) -> None:
        lib = ctypes.PyDLL(library)
        u32, ptr = ctypes.c_uint32, ctypes.c_void_p
        signatures: dict[str, list[Any]] = {
            "regoInputInt": [ptr, ctypes.c_int64],
            "regoInputFloat": [ptr, ctypes.c_double],
            "regoInputString": [ptr, ctypes.c_char_p],
            "regoInputBoolean": [ptr, ctypes.c_bool],
            "regoInputNull": [ptr],
            "regoInputObjectItem": [ptr],
            "regoInputObject": [ptr, u32],
            "regoInputArray": [ptr, u32],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, u32
        lib.regoNewInput.argtypes, lib.regoNewInput.restype = [], ptr
        lib.regoFreeInput.argtypes, lib.regoFreeInput.restype = [ptr], None
        self.new, self.free = lib.regoNewInput, lib.regoFreeInput
        self.int, self.float, self.string = lib.regoInputInt, lib.regoInputFloat, lib.regoInputString
        self.boolean, self.null = lib.regoInputBoolean, lib.regoInputNull
        self.item, self.object, self.array = lib.regoInputObjectItem, lib.regoInputObject, lib.regoInputArray
        # The query: only the evaluation releases the GIL (CDLL); the rest are quick calls.
        lib.regoSetInput.argtypes, lib.regoSetInput.restype = [ptr, ptr], u32
        lib.regoOutputOk.argtypes, lib.regoOutputOk.restype = [ptr], ctypes.c_bool
        lib.regoOutputJSONSize.argtypes, lib.regoOutputJSONSize.restype = [ptr], u32
        lib.regoOutputJSON.argtypes, lib.regoOutputJSON.restype = [ptr, ctypes.c_char_p, u32], u32
        lib.regoFreeOutput.argtypes, lib.regoFreeOutput.restype = [ptr], None
        self.set_input, self.output_ok = lib.regoSetInput, lib.regoOutputOk
        self.output_json_size, self.output_json, self.free_output = (
            lib.regoOutputJSONSize, lib.regoOutputJSON, lib.regoFreeOutput
        )
        evaluate = ctypes.CDLL(library).regoBundleQueryEntrypoint
        evaluate.argtypes, evaluate.restype = [ptr, ptr, ctypes.c_char_p], ptr
        self.evaluate = evaluate


_api: _Api | None = None


def _bound(regopy: Any) -> _Api:
    global _api
    if _api is None:
        _api = _Api(regopy.rego_shared.rego._name)  # the library regopy itself loaded
    return _api


def rego_input(regopy: Any, document: Any) -> Term:
    """``document`` (a JSON value) as an input ``Term``; ValueError if JSON cannot carry it.

    ``regopy`` is the module as ``rego.load_regopy`` returns it (it must be
    loaded after other native libraries, so it is passed in, not imported).
    """
    api = _bound(regopy)
    handle = api.new()
    try:
        _add(api, handle, document, 0)
    except BaseException:
        api.free(handle)
        raise
    return Term(api, handle)


class Term:
    """A built input term; freed (through ``PyDLL``, like its building) when dropped.

    ``regopy.Input`` would free it through ``CDLL``, one more GIL release and
    take-back per decision.
    """

    __slots__ = ("_api", "_impl")

    def __init__(self, api: _Api, handle: int) -> None:
        self._api, self._impl = api, handle

    def __del__(self) -> None:
        self._api.free(self._impl)


def _add(api: _Api, handle: int, value: Any, depth: int) -> None:
    # Runs for every value of every request's document: the common types come
    # first, and the Mapping ABC check (slower than the call itself) last.
    if depth > MAX_DEPTH:
        raise ValueError(f"the input document nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        code = api.string(handle, _escaped(value))
    elif isinstance(value, dict):
        code = _add_object(api, handle, value, depth)
    elif isinstance(value, list | tuple):
        for member in value:
            _add(api, handle, member, depth + 1)
        code = api.array(handle, len(value))
    elif value is None:
        code = api.null(handle)
    elif value is True or value is False:
        code = api.boolean(handle, value)
    elif isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise ValueError("the input document holds an integer outside 64 bits")
        code = api.int(handle, value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the input document holds a NaN or an infinity, which JSON cannot carry")
        code = api.float(handle, value)
    elif isinstance(value, Mapping):
        code = _add_object(api, handle, value, depth)
    else:
        raise ValueError(f"the input document holds a {type(value).__name__}, which JSON cannot carry")
    if code:
        _refused(code)


def _add_object(api: _Api, handle: int, value: Mapping[Any, Any], depth: int) -> int:
    for key, member in value.items():
        if not isinstance(key, str):
            raise ValueError("the input document has a key that is not a string")
        code = api.string(handle, _escaped(key))
        if code:
            _refused(code)
        _add(api, handle, member, depth + 1)
        code = api.item(handle)
        if code:
            _refused(code)
    return int(api.object(handle, len(value)))


# Escaped forms of strings seen lately: a document's keys, and most of its values
# (tenant, principal, roles, model, route), are the same request after request.
_ESCAPED: dict[str, bytes] = {}
_ESCAPED_MAX = 4096
_SHORT = 256  # longer strings are not kept


def _escaped(text: str) -> bytes:
    found = _ESCAPED.get(text)
    if found is not None:
        return found
    escaped = json.dumps(text, ensure_ascii=False)[1:-1] if _NEEDS_ESCAPE.search(text) else text
    encoded = escaped.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError, a ValueError
    if len(text) <= _SHORT:
        remember(_ESCAPED, text, encoded, _ESCAPED_MAX)
    return encoded


def _refused(code: int) -> None:
    raise ValueError(f"rego-cpp refused a value of the input document (code {code})")


def set_input(regopy: Any, interpreter: Any, value: Term) -> None:
    """Give ``interpreter`` (a ``regopy.Interpreter``) the input ``value``; hold ``value`` while it is in use."""
    if _bound(regopy).set_input(interpreter._impl, value._impl) != 0:
        raise regopy.RegoError(regopy.rego_shared.rego_get_error(interpreter._impl))


def query(regopy: Any, interpreter: Any, bundle: Any, entrypoint: bytes, value: Term) -> tuple[bool, str]:
    """Run ``bundle``'s ``entrypoint`` on ``value`` (from ``rego_input``): (ok, the output as JSON text).

    ``interpreter`` keeps pointing into ``value`` afterwards (see above).
    Raises ``regopy.RegoError`` when rego-cpp refuses the input or the query.
    """
    api = _bound(regopy)

    def refused() -> Exception:
        return regopy.RegoError(regopy.rego_shared.rego_get_error(interpreter._impl))

    set_input(regopy, interpreter, value)
    output = api.evaluate(interpreter._impl, bundle._impl, entrypoint)
    if not output:
        raise refused()
    try:
        size = api.output_json_size(output)
        text = ctypes.create_string_buffer(size)
        if api.output_json(output, text, size) != 0:
            raise refused()
        return bool(api.output_ok(output)), text.value.decode("utf-8")
    finally:
        api.free_output(output)


def expressions(text: str) -> list[Any]:
    """The first result's expressions in a query's JSON output (``[]`` when undefined); ValueError if unreadable."""
    if text == "undefined":
        return []
    parsed = json.loads(text)
    first = parsed[0] if isinstance(parsed, list) and parsed else parsed
    found = first.get("expressions") if isinstance(first, dict) else None
    if not isinstance(found, list):
        raise ValueError("the query's output has no expressions")
    return found
