"""rego-cpp through ``regopy``: the library loaded after those it must follow, a policy compiled, an input made.

Every use of regopy in the project goes through ``load_regopy``; the embedded
OPA engine (``opa.EmbeddedRego``) compiles with ``compile_rego``, and a policy
is refused when it is written unless ``check_rego`` compiles it.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.guardrails.errors import OpaError
from inferflux.policy.guardrails.rego_input import rego_input


def load_regopy() -> Any:
    """The ``regopy`` module, loaded after the native libraries it must follow.

    With regopy's ``librego_shared.so`` loaded first, loading ``re2``'s or
    torch's native library afterwards corrupts the heap and aborts the process
    (seen as "munmap_chunk(): invalid pointer" or "double free" in their static
    initialisers); loaded after them, all three work together. ``re2`` is
    imported by this package already; torch, when installed, is imported here.
    """
    if "regopy" not in sys.modules:
        import re2  # noqa: F401

        if "torch" not in sys.modules and importlib.util.find_spec("torch") is not None:
            import torch  # noqa: F401
    import regopy

    return regopy


def entrypoint(query: str) -> str:
    """A query's bundle entry point: ``data.inferflux.guardrails.decision`` is ``inferflux/guardrails/decision``."""
    return query.removeprefix("data.").replace(".", "/")


def compile_rego(rego: str, query: str) -> tuple[Any, Any]:
    """An interpreter holding ``rego``, and its bundle built for ``query``'s entry point; OpaError if it
    does not compile."""
    regopy = load_regopy()
    interpreter = regopy.Interpreter()
    try:
        interpreter.add_module("policy.rego", rego)
        bundle = interpreter.build(None, [entrypoint(query)])
    except regopy.RegoError as exc:
        raise OpaError(f"the Rego policy does not compile: {_rego_message(exc)}") from None
    if not bundle.ok():
        raise OpaError("the Rego policy does not compile")
    return interpreter, bundle


def _rego_message(exc: Exception) -> str:
    # rego-cpp errors are S-expressions; keep the messages and their places.
    text = str(exc)
    messages = [line.strip()[len("(errormsg ") :].rstrip(")") for line in text.splitlines() if "(errormsg" in line]
    places = [line.strip()[len("(error ") :] for line in text.splitlines() if line.strip().startswith("(error ")]
    parts = [f"{m.split(':', 1)[-1]} at {p.split(':', 1)[-1]}" for m, p in zip(messages, places, strict=False)]
    return "; ".join(parts[:3]) or text[:300]


def check_rego(rego: str, query: str) -> None:
    """ValidationFailed (on ``spec.opa.rego``) unless ``rego`` compiles with an entry point for ``query``."""
    try:
        compile_rego(rego, query)
    except OpaError as exc:
        raise ValidationFailed(str(exc), param="spec.opa.rego") from None


def prepare_input(document: Any) -> Any:
    """``document`` as rego-cpp's input term (``rego_input``); OpaError if JSON cannot carry it."""
    try:
        return rego_input(load_regopy(), document)
    except ValueError as exc:
        raise OpaError(f"evaluation failed: {exc}") from None
