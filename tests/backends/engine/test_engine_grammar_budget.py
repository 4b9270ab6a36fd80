"""Grammars under a budget (issue 44): a hostile grammar is refused within its budget in a worker process
that is killed, a cancelled compile stops at once, the compiled-grammar cache is bounded by bytes, and a
mask over llguidance's limits while decoding ends its own request, cleanly, and no other.

The grammar library is the real llguidance on the real SmolLM2 vocabulary; the model is the scripted
echo backend of ``test_engine_guided``. The hostile grammar is a string whose ``allOf`` holds 24
``pattern``s: llguidance needs more than 30 s and 1.2 GB to refuse it, outside its own fuel limits.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from inferflux.backends.engine import (
    AsyncEngine,
    GrammarBudget,
    GrammarCancelledError,
    GrammarTooComplexError,
    GuidedSpec,
    SamplingParams,
)
from inferflux.backends.engine.grammar_compiler import GrammarCompiler
from inferflux.backends.engine.grammar_sandbox import GrammarSandbox

from processes import alive, cpu_seconds
from test_engine_guided import EOS, TOK, VOCAB, encode, engine_for, scripted

pytestmark = pytest.mark.slow  # grammar worker processes, stopped over real CPU time

SMALL = GrammarBudget(cpu_seconds=0.5, wall_seconds=10.0)
LARGE = GrammarBudget(cpu_seconds=120.0, wall_seconds=300.0)


def hostile(letter: str) -> GuidedSpec:
    """A string that must match 24 patterns at once (each test its own letter: verdicts are remembered)."""
    schema = {"type": "object", "properties": {"s": {"type": "string",
                                                     "allOf": [{"pattern": f"{letter}{i}"} for i in range(24)]}},
              "required": ["s"]}  # fmt: skip
    return GuidedSpec("json_schema", schema=schema)


def small_spec(i: int) -> GuidedSpec:
    return GuidedSpec("json_schema", schema={"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                             "required": [f"k{i}"]})  # fmt: skip


def test_a_grammar_over_its_cpu_budget_is_refused_and_its_worker_killed() -> None:
    sandbox = GrammarSandbox(workers=1)
    compiler = GrammarCompiler(TOK, VOCAB, [EOS], sandbox=sandbox)
    with pytest.raises(GrammarTooComplexError, match="CPU time") as caught:
        compiler.compile(hostile("a"), SMALL)
    assert caught.value.param == "guided"
    stats = sandbox.snapshot()
    assert stats["over_budget"] == 1 and stats["workers"] == 0  # killed, not kept
    # The verdict is remembered: the same grammar again is refused without a worker.
    with pytest.raises(GrammarTooComplexError):
        compiler.compile(hostile("a"), SMALL)
    assert sandbox.snapshot()["remembered"] == 1 and sandbox.snapshot()["workers_started"] == 1
    # And an ordinary grammar still compiles, in a new worker.
    assert compiler.compile(small_spec(0), SMALL).guide() is not None
    sandbox.close()


def test_a_cancelled_compile_kills_its_worker_at_once() -> None:
    sandbox = GrammarSandbox(workers=1)
    compiler = GrammarCompiler(TOK, VOCAB, [EOS], sandbox=sandbox)
    compiler.compile(small_spec(1), LARGE)  # the worker is up and holds the vocabulary
    [pid] = [w.pid for w in sandbox._idle]
    cancel = threading.Event()
    failure: list[BaseException] = []

    def compile_hostile() -> None:
        try:
            compiler.compile(hostile("b"), LARGE, cancel)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            failure.append(exc)

    thread = threading.Thread(target=compile_hostile)
    thread.start()
    deadline = time.monotonic() + 60
    while cpu_seconds(pid) < 0.3:  # the worker is compiling it
        assert time.monotonic() < deadline and thread.is_alive(), failure
        time.sleep(0.02)
    cancel.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], GrammarCancelledError)
    assert not alive(pid)
    assert sandbox.snapshot()["cancelled"] == 1 and sandbox.snapshot()["workers"] == 0
    sandbox.close()


def test_a_free_worker_goes_to_the_tenant_holding_the_fewest() -> None:
    """One worker. Tenant a's hostile grammar holds it and two more of a's wait; tenant b's grammar, arriving
    after them, gets the worker next: one tenant's queue delays another's grammar by one compile, not by
    the whole queue (first come, first served would run b's last)."""
    from llguidance import LLMatcher

    sandbox = GrammarSandbox(workers=1)
    budget = GrammarBudget(cpu_seconds=0.5, wall_seconds=60.0, queue_seconds=300.0)
    grammar = {k: LLMatcher.grammar_from_json_schema(hostile(k).schema) for k in ("c", "d", "e")}
    small = LLMatcher.grammar_from_json_schema(small_spec(7).schema)
    served: list[str] = []

    def check(owner: str, text: str, name: str) -> None:
        try:
            sandbox.check(text, None, budget, owner=owner)
        except GrammarTooComplexError:
            pass
        served.append(name)

    threads = []
    for owner, text, name, waiting in (("a", grammar["c"], "a1", 0), ("a", grammar["d"], "a2", 1),
                                       ("a", grammar["e"], "a3", 2), ("b", small, "b", 3)):  # fmt: skip
        threads.append(threading.Thread(target=check, args=(owner, text, name)))
        threads[-1].start()
        deadline = time.monotonic() + 60
        while not (sandbox.snapshot()["waiting"] == waiting and sandbox.busy_pids()):
            assert time.monotonic() < deadline, sandbox.snapshot()
            time.sleep(0.005)
    for thread in threads:
        thread.join(timeout=120)
    assert served == ["a1", "b", "a2", "a3"]
    sandbox.close()


def test_the_compiled_grammar_cache_is_bounded_by_bytes() -> None:
    """Each grammar weighs at least twice its spec's JSON (the spec it keeps), here 200 KB of description:
    a 4 MiB cache keeps at most ten of them, where the count alone (256) would keep every one."""
    bound = 4 << 20

    def described(i: int) -> GuidedSpec:
        schema = {"type": "object", "description": f"{i} " + "x" * 200_000, "properties": {"k": {"type": "integer"}}}
        return GuidedSpec("json_schema", schema=schema)

    compiler = GrammarCompiler(TOK, VOCAB, [EOS], cache_bytes=bound)
    for i in range(30):
        compiler.compile(described(i))
        assert compiler.cache_bytes_used <= bound
    assert 1 <= compiler.cached <= 10
    compiled = compiler.num_compiled
    compiler.compile(described(29))
    assert compiler.num_compiled == compiled  # the newest is still there
    compiler.compile(described(0))
    assert compiler.num_compiled == compiled + 1  # the oldest was evicted and is built again


NAME_N = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"]}  # fmt: skip


def test_a_mask_over_its_limits_ends_its_own_request_and_frees_its_blocks() -> None:
    """With llguidance's per-step limit at 5 Earley items, the first mask passes (the compile checks it)
    and a later one does not: that request ends with a GrammarTooComplexError, its sequence and KV
    freed in the step, and the unguided request beside it runs to its end unchanged."""
    doc = encode({"name": "abc", "n": 12})
    plain = TOK.encode(" a plain answer", add_special_tokens=False)
    engine = engine_for(lambda ctx, vocab: _both(ctx, vocab, doc, plain))
    engine.grammars = GrammarCompiler(TOK, VOCAB, [EOS], limits={"step_max_items": 5, "verbose_errors": False})
    spec = GuidedSpec("json_schema", schema=NAME_N)
    engine.grammars.compile(spec)  # within its limits at the start
    assert engine.grammars.cached == 1
    aengine = AsyncEngine(engine)

    async def run() -> tuple[BaseException | None, str]:
        async def guided() -> BaseException | None:
            try:
                async for _ in aengine.generate("g", [1, 2], SamplingParams(guided=spec, max_tokens=40)):
                    pass
            except GrammarTooComplexError as exc:
                return exc
            return None

        async def free() -> str:
            text = ""
            async for out in aengine.generate("f", [3, 4, 5], SamplingParams(max_tokens=len(plain) + 1)):
                text += out.new_text
            return text

        return tuple(await asyncio.gather(guided(), free()))  # type: ignore[return-value]

    try:
        error, text = asyncio.run(run())
    finally:
        aengine.shutdown(5)
    assert isinstance(error, GrammarTooComplexError) and error.param == "guided"
    assert "Too many items" in str(error) and "<state>" not in str(error)
    assert text == " a plain answer"
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_blocks_free == stats.num_blocks_total
    assert engine.grammars.cached == 0  # a grammar whose mask failed is not kept


def _both(ctx, vocab, doc, plain):
    """The guided request (prompt [1, 2]) wants ``doc``, the free one (prompt [3, 4, 5]) ``plain``."""
    import numpy as np

    row = np.zeros(vocab, dtype=np.float32)
    target, start = (doc, 2) if ctx[0] == 1 else (plain, 3)
    t = len(ctx) - start
    row[target[t] if t < len(target) else EOS] = 20.0
    return row
