"""A grammar sandbox worker: one process that compiles grammars for ``grammar_sandbox`` under rlimits.

Run as a script (``python -I grammar_worker.py``), so it imports llguidance and the
standard library and nothing of the project: a worker starts in about 0.1 s. It
reads requests on stdin and writes answers on stdout, each a 4-byte big-endian
length and that many bytes of JSON:

* ``{"grammar", "vocabulary", "limits", "cpu_seconds", "memory_bytes"}``: build the
  grammar (llguidance's JSON form) into a matcher for the named vocabulary and
  compute its first mask; without a vocabulary, ``LLMatcher.validate_grammar``.
  A request that names a vocabulary this worker has not loaded also carries
  ``tokenizer``, ``n_vocab`` and ``eos`` (the vocabulary is loaded first, outside
  the budget). Answers ``{"started": true}`` once the budgeted part begins, then
  ``{"error": <llguidance's objection or null>, "bytes": <resident growth>, "cpu": <seconds>}``.

The budget is enforced twice: here by rlimits (``RLIMIT_CPU`` in whole seconds, above
the parent's bound, and ``RLIMIT_AS`` at the baseline plus ``memory_bytes``; an
allocation llguidance cannot get aborts the process), and by the parent, which
reads this process's CPU time and resident memory from /proc and kills it at
the exact bound. A worker that dies answers nothing; the parent reads its exit.
A worker whose parent died reads the end of its input and exits (one busy
compiling ends at its ``RLIMIT_CPU``).
"""

from __future__ import annotations

import json
import math
import os
import resource
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")


def _read(stream: BinaryIO) -> dict[str, Any] | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack(head)
    body = stream.read(length)
    if len(body) < length:
        return None
    message: dict[str, Any] = json.loads(body)
    return message


def _write(stream: BinaryIO, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def _statm(field: int) -> int:
    """A field of /proc/self/statm in bytes (0: size, 1: resident); 0 where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[field]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _limit(cpu_seconds: float, memory_bytes: int) -> None:
    used = _cpu()
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    # Whole seconds, a second above the parent's exact bound: the backstop, should the parent stall.
    soft = math.ceil(used + cpu_seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    size = _statm(0)
    if size:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = size + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _unlimit() -> None:
    for which in (resource.RLIMIT_AS, resource.RLIMIT_CPU):
        _, hard = resource.getrlimit(which)
        resource.setrlimit(which, (hard, hard))


def _build(matcher_class: Any, grammar: str, vocabulary: Any, limits: Any, before: int) -> tuple[str, int]:
    """llguidance's objection to ``grammar`` ("" if none) and the resident growth building it took."""
    if vocabulary is None:
        return matcher_class.validate_grammar(grammar, None, limits=limits), _statm(1) - before
    matcher = matcher_class(vocabulary, grammar, log_level=0, limits=limits)
    if not matcher.is_error():
        matcher.compute_bitmask()  # the first mask: what every request of this grammar pays at once
    return (matcher.get_error() if matcher.is_error() else ""), _statm(1) - before


def main() -> None:
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer

    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # nothing but answers on the answer pipe
    vocabularies: dict[str, Any] = {}
    while True:
        request = _read(requests)
        if request is None:
            return
        name = request.get("vocabulary")
        if name is not None and name not in vocabularies:
            vocabularies[name] = LLTokenizer(request["tokenizer"], n_vocab=request["n_vocab"],
                                             eos_token=request["eos"] or None)  # fmt: skip
        limits = LLParserLimits(**request["limits"])
        _limit(request["cpu_seconds"], request["memory_bytes"])
        _write(answers, {"started": True})
        before, cpu = _statm(1), _cpu()
        try:
            error, grown = _build(LLMatcher, request["grammar"], vocabularies.get(name), limits, before)
        except (ValueError, TypeError, RuntimeError) as exc:  # llguidance refuses what it was given
            error, grown = f"{type(exc).__name__}: {exc}", 0
        cpu = _cpu() - cpu
        _unlimit()
        _write(answers, {"error": error or None, "bytes": max(0, grown), "cpu": cpu})


if __name__ == "__main__":
    main()
