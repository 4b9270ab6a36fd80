"""The engine client: runs one HTTP request's sequences and merges their outputs.

A request with ``n`` choices (or several prompts) becomes several engine
sequences. Each is consumed by its own task so a slow choice never stalls the
others; outputs reach the route through one queue, in arrival order.
Cancelling or closing a ``Generation`` closes every engine generator, which is
how the engine learns to abort the sequence and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from inferflux.backends.engine import RequestTimings
from inferflux.backends.engine.errors import (
    CacheCapacityError,
    EngineDeadError,
    GrammarBusyError,
    GrammarTooComplexError,
    InvalidRequestError,
    PromptTooLongError,
)

from inferflux.backends.openai.errors import UpstreamError, UpstreamRejected
from inferflux.backends.openai.errors import UpstreamUnavailable as UpstreamUnavailableError
from inferflux.gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    GrammarBusy,
    InternalError,
    InvalidRequest,
    ModelNotReady,
    SchemaTooComplex,
    ServiceUnavailable,
    UpstreamUnavailable,
)
from inferflux.gateway.pipeline.tool_calls import ToolOutput

if TYPE_CHECKING:
    from inferflux.backends.engine import EngineRequest, RequestOutput
    from inferflux.backends.openai.request import RemoteRequest

    from inferflux.gateway.models.served import ServedModel
    from inferflux.gateway.pipeline.tool_calls import ToolStream
    from inferflux.policy.guardrails import OutputStream

log = logging.getLogger("inferflux.gateway.pipeline.generation")


@dataclass
class ChoiceSpec:
    index: int
    prompt_index: int
    request: EngineRequest | RemoteRequest  # checked by the plan (``gateway.pipeline.plan``), run as it is


@dataclass
class ChoiceEvent:
    index: int
    output: RequestOutput


@dataclass
class _Finished:
    index: int


@dataclass
class _Failed:
    index: int
    error: BaseException


@dataclass
class _Clock:
    """One choice's moments (``time.perf_counter()``): the engine's timings from its last output; a
    remote model's, or a choice cut short, from what the gateway saw (no queue: admitted on arrival)."""

    started: float = 0.0
    first: float = 0.0
    last: float = 0.0
    engine: RequestTimings | None = None

    def saw(self, out: RequestOutput) -> None:
        self.last = time.perf_counter()
        if not self.first and (out.new_token_ids or out.new_text):
            self.first = self.last
        self.engine = out.timings or self.engine

    def timings(self) -> RequestTimings:
        return self.engine or RequestTimings(self.started, self.started, self.first or self.last, self.last)


@dataclass
class Usage:
    prompt_tokens_by_prompt: dict[int, int] = field(default_factory=dict)
    completion_tokens_by_choice: dict[int, int] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        # OpenAI counts a prompt once however many choices sample from it.
        return sum(self.prompt_tokens_by_prompt.values())

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion_tokens_by_choice.values())

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class Generation:
    """Async iterator of ``ChoiceEvent``; use ``async with`` or call ``close``.

    Engine failures are raised as GatewayErrors. ``on_first_token`` is called
    once, with the seconds since ``started``, when the first token arrives;
    ``on_close`` with the generation when it closes (its usage, findings and
    texts final).
    """

    def __init__(
        self,
        served: ServedModel,
        choices: list[ChoiceSpec],
        *,
        started: float | None = None,
        on_first_token: Callable[[float], None] | None = None,
        on_close: Callable[[Generation], None] | None = None,
        param_names: dict[str, str] | None = None,
        output_check: Callable[[], OutputStream] | None = None,
        tool_stream: Callable[[], ToolStream] | None = None,
        timed: bool = False,
    ) -> None:
        self.served = served
        self.choices = choices
        self._by_index = {c.index: c for c in choices}
        self.param_names = param_names or {}
        self.usage = Usage()
        self._started = time.perf_counter() if started is None else started
        self._on_first_token = on_first_token
        self._on_close = on_close
        self._queue: asyncio.Queue[ChoiceEvent | _Finished | _Failed] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._remaining = len(choices)
        self._saw_token = False
        self._closed = False
        # Output guardrails: one incremental checker per choice. A choice they
        # block is cancelled and ends with finish_reason "content_filter".
        self._checks = {c.index: output_check() for c in choices} if output_check is not None else {}
        self._cut: set[int] = set()
        # Tool calling: each choice's text split into content and calls (gateway.pipeline.tool_calls), before the
        # guardrails read the content; the calls' arguments are checked there.
        self._tools = {c.index: tool_stream() for c in choices} if tool_stream is not None else {}
        self.output_findings: list[Any] = []
        self._text: dict[int, list[str]] = {c.index: [] for c in choices}  # what went out, for the audit digest
        # ``timed`` (a traced request): each choice's moments, for ``timings``.
        self._clocks = {c.index: _Clock() for c in choices} if timed else None

    async def __aenter__(self) -> Generation:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        if self._tasks:
            return
        for choice in self.choices:
            self._tasks.append(asyncio.create_task(self._run(choice), name=f"generate-{choice.request.request_id}"))
        self._task_of = {c.index: t for c, t in zip(self.choices, self._tasks)}

    async def _run(self, choice: ChoiceSpec) -> None:
        if self._clocks is not None:
            self._clocks[choice.index].started = time.perf_counter()
        stream = self.served.engine.stream(choice.request)
        try:
            # aclosing: the generator is closed in the task that iterated it,
            # also when that task is cancelled, so the engine aborts the sequence.
            async with contextlib.aclosing(stream):
                async for output in stream:
                    self._queue.put_nowait(ChoiceEvent(choice.index, output))
            self._queue.put_nowait(_Finished(choice.index))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait(_Failed(choice.index, exc))

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> ChoiceEvent:
        self.start()
        while self._remaining > 0:
            item = await self._queue.get()
            if item.index in self._cut:
                continue  # a blocked choice: nothing more of it goes out
            if isinstance(item, _Finished):
                self._remaining -= 1
                continue
            if isinstance(item, _Failed):
                raise self._to_gateway_error(item.error)
            out = item.output
            if self._clocks is not None:
                self._clocks[item.index].saw(out)
            self.usage.prompt_tokens_by_prompt[self._by_index[item.index].prompt_index] = out.prompt_tokens
            self.usage.completion_tokens_by_choice[item.index] = out.completion_tokens
            # A remote model's outputs carry text but no token ids.
            if (out.new_token_ids or out.new_text) and not self._saw_token:
                self._saw_token = True
                if self._on_first_token is not None:
                    self._on_first_token(time.perf_counter() - self._started)
            if out.finished and out.finish_reason == "abort":
                raise ServiceUnavailable("The engine aborted the generation; retry the request")
            if self._tools:
                step = self._tools[item.index].step(item.output)
                self.output_findings += step.findings
                item = ChoiceEvent(item.index, step.output)
                if step.blocked:
                    return self._cut_off(item, "")
            if self._checks:
                item = self._checked(item)
            self._text[item.index].append(item.output.new_text)
            return item
        raise StopAsyncIteration

    def timings(self) -> RequestTimings | None:
        """When the request's choices arrived, were admitted, got their first and last tokens (the
        earliest of each, the latest last): its trace's engine stages. None unless ``timed``, or
        before any choice said anything."""
        if self._clocks is None:
            return None
        seen = [clock.timings() for clock in self._clocks.values() if clock.last]
        if not seen:
            return None
        return RequestTimings(min(t.arrived for t in seen), min(t.admitted for t in seen),
                              min(t.first_token for t in seen), max(t.finished for t in seen))  # fmt: skip

    def texts(self) -> list[str]:
        """Each choice's text as sent so far (its calls written after it), in choice order."""
        tools = self._tools
        return ["".join(self._text[c.index]) + (tools[c.index].text() if tools else "") for c in self.choices]

    def tool_names(self) -> list[str]:
        """The functions the answer called, in choice and call order (what the audit records of them)."""
        return [name for c in self.choices if c.index in self._tools for name, _ in self._tools[c.index].calls]

    def _checked(self, item: ChoiceEvent) -> ChoiceEvent:
        """``item`` with its text passed through the choice's output guardrails."""
        check, out = self._checks[item.index], item.output
        step = check.flush(out.new_text) if out.finished else check.feed(out.new_text)
        text, blocked = step.text, step.blocked
        self.output_findings += step.findings
        if blocked:
            return self._cut_off(item, text)
        return ChoiceEvent(item.index, replace(out, new_text=text)) if text != out.new_text else item

    def _cut_off(self, item: ChoiceEvent, text: str) -> ChoiceEvent:
        """Stop generating a blocked choice; its stream ends here, as OpenAI ends a filtered one."""
        self._cut.add(item.index)
        self._remaining -= 1
        self._task_of[item.index].cancel()
        out = replace(item.output, new_text=text, finished=True, finish_reason="content_filter")
        return ChoiceEvent(item.index, replace(out, tool_calls=()) if isinstance(out, ToolOutput) else out)

    def _to_gateway_error(self, exc: BaseException) -> GatewayError:
        mapped = engine_error_to_gateway(exc, param_names=self.param_names)
        if isinstance(mapped, InternalError):
            log.error("engine failed on %s", self.served.name, exc_info=exc)
        return mapped

    async def close(self, *, report: bool = True) -> None:
        """Stop every sequence (the engine aborts those still running) and, with ``report``, call ``on_close``."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            if not task.done():
                task.cancel()
        results: list[Any] = await asyncio.gather(*self._tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("generation task failed", exc_info=result)
        if report and self._on_close is not None:
            self._on_close(self)


def engine_error_to_gateway(exc: BaseException, *, param_names: dict[str, str] | None = None) -> GatewayError:
    """The client-facing error for an exception raised by the engine.

    ``param_names`` renames the engine's parameter names to the API's where
    they differ (the completions API calls ``top_logprobs`` ``logprobs``).
    """
    if isinstance(exc, GatewayError):
        return exc
    names = param_names or {}
    if isinstance(exc, PromptTooLongError | CacheCapacityError):
        # To a client, a request the KV cache can never hold is a context that is too long.
        return ContextLengthExceeded(str(exc), param=names.get(exc.param or "", exc.param))
    if isinstance(exc, GrammarTooComplexError):
        return SchemaTooComplex(str(exc), param=names.get(exc.param or "", exc.param))
    if isinstance(exc, InvalidRequestError):
        return InvalidRequest(str(exc), param=names.get(exc.param or "", exc.param))
    if isinstance(exc, EngineDeadError):
        return ModelNotReady(f"The model's engine is not running: {exc}")
    if isinstance(exc, GrammarBusyError):
        return GrammarBusy(str(exc), retry_after=1)
    if isinstance(exc, UpstreamError):
        return upstream_error_to_gateway(exc)
    return InternalError("The engine failed while generating")


def upstream_error_to_gateway(exc: UpstreamError) -> GatewayError:
    """A remote model's failure as the client sees it: its own mistakes as 4xx, the fleet's as 503.

    The fleet's messages are already short and scrubbed of endpoints and
    credentials; an upstream refusing our credential is the operator's
    problem, not the client's, so it is a 503 like any outage (and logged).
    """
    if isinstance(exc, UpstreamUnavailableError):
        return UpstreamUnavailable(f"No upstream server can take the request now: {exc}", retry_after=exc.retry_after)
    if isinstance(exc, UpstreamRejected):
        if exc.status in (400, 404, 413, 422):
            if exc.code == "context_length_exceeded":
                return ContextLengthExceeded(f"The upstream server refused the request: {exc}", param=exc.param)
            return InvalidRequest(f"The upstream server refused the request: {exc}", param=exc.param)
        if exc.status == 429:
            return UpstreamUnavailable(f"The upstream server is rate limiting: {exc}", retry_after=1)
        log.error("the upstream refused the gateway's request with %s: %s", exc.status, exc)
    return ServiceUnavailable(f"The upstream server failed: {exc}")
