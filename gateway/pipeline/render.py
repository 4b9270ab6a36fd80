"""How engine outputs become the API's answer: one JSON body, or an SSE stream.

``respond`` answers a started ``Generation``: whole (every output collected,
then the renderer's ``full``) or streamed (the renderer's ``sse_body``, sent by
``gateway.pipeline.sse.SSEResponse``). A ``Renderer`` knows one API's shapes
(chat completions, text completions, an adapter's vendor). Nothing here decides
anything: the request's policy has run before the first output reaches a renderer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import JSONResponse, Response

from inferflux.backends.engine import RequestOutput, TokenLogprob

from inferflux.gateway.errors import GatewayError, error_body
from inferflux.gateway.metrics import CLIENT_CLOSED_STATUS
from inferflux.gateway.pipeline.completions import keep_best
from inferflux.gateway.pipeline.generation import ChoiceEvent, Generation, Usage
from inferflux.gateway.pipeline.sse import SSE_DONE, ClientDisconnected, SSEResponse, sse_error_end, sse_event
from inferflux.gateway.pipeline.tool_calls import ToolCallDelta, ToolOutput, assemble

if TYPE_CHECKING:
    from inferflux.policy.errors import ApiError

    from inferflux.gateway.pipeline.call import Call
    from inferflux.gateway.pipeline.plan import Plan
    from inferflux.gateway.pipeline.protocol import GenerationRequest


async def respond(call: Call, gen: Generation, render: Renderer, req: GenerationRequest,
                  headers: dict[str, str]) -> Response:  # fmt: skip
    """The answer to ``req`` from ``gen`` (started, every policy allowing): one JSON body, or an SSE stream
    once its first output is there; ``headers`` go on either. ``gen`` is closed, and so settled (policy 4),
    when the body is complete, the stream ends, or the client leaves."""
    if not req.stream:
        try:
            async with gen:
                outputs = await call.watched(collect(gen))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return JSONResponse(render.full(outputs, gen.usage), headers=headers)
    try:
        # Wait for the first output before sending headers, so that admission
        # errors (prompt too long, overload) still get their real status.
        first = await call.watched(anext(gen, None))
    except ClientDisconnected:
        await gen.close()
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except BaseException:
        await gen.close()
        raise
    return SSEResponse(render.sse_body(gen, first, req.include_usage), on_close=gen.close, headers=headers,
                       error_end=render.error_end)  # fmt: skip


async def collect(gen: Generation) -> dict[int, list[RequestOutput]]:
    """Every choice's outputs, for a whole (non-streamed) answer."""
    outputs: dict[int, list[RequestOutput]] = {c.index: [] for c in gen.choices}
    async for event in gen:
        outputs[event.index].append(event.output)
    return outputs


class Renderer(Protocol):
    """Turns engine outputs into one API's response objects."""

    def full(self, outputs: dict[int, list[RequestOutput]], usage: Usage) -> dict[str, Any]: ...

    def stream_start(self) -> list[dict[str, Any]]: ...

    def stream_event(self, event: ChoiceEvent, include_usage: bool) -> dict[str, Any] | None: ...

    def usage_chunk(self, usage: Usage) -> dict[str, Any]: ...

    def sse_body(self, gen: Generation, first: ChoiceEvent | None, include_usage: bool) -> AsyncIterator[bytes]:
        """The stream's events, from ``first`` (None: the generation had no output) on."""
        ...

    def error_end(self, exc: ApiError) -> bytes:
        """How the stream ends in error once its headers are gone (a drain's grace over)."""
        ...


def _is_empty(out: RequestOutput) -> bool:
    # The engine may hold back text (an incomplete UTF-8 sequence, a possible
    # stop string); a chunk with nothing in it is noise for clients.
    return not out.new_text and not out.finished and not out.logprobs and not _calls(out)


def _calls(out: RequestOutput) -> tuple[ToolCallDelta, ...]:
    return out.tool_calls if isinstance(out, ToolOutput) else ()


async def stream_chunks(
    gen: Generation, first: ChoiceEvent | None, render: Renderer, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks in this API's shape (no usage chunk); a ``GatewayError`` of the generation is raised."""
    for chunk in render.stream_start():
        yield chunk
    if first is None:
        return
    chunk = render.stream_event(first, include_usage)
    if chunk is not None:
        yield chunk
    async for event in gen:
        chunk = render.stream_event(event, include_usage)
        if chunk is not None:
            yield chunk


class OpenAIRenderer(Renderer):
    """The chat and completions renderers' stream: their chunks as SSE events, then ``data: [DONE]``."""

    async def sse_body(self, gen: Generation, first: ChoiceEvent | None, include_usage: bool) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream_chunks(gen, first, self, include_usage):
                yield sse_event(chunk)
        except GatewayError as exc:
            # Headers are gone already; the error travels in the stream, as OpenAI does.
            yield sse_event(error_body(exc))
            yield SSE_DONE
            return
        if include_usage:
            yield sse_event(self.usage_chunk(gen.usage))
        yield SSE_DONE

    def error_end(self, exc: ApiError) -> bytes:
        return sse_error_end(exc)


def _finish_reason(outputs: list[RequestOutput]) -> str | None:
    return outputs[-1].finish_reason if outputs and outputs[-1].finished else None


class ChatRenderer(OpenAIRenderer):
    def __init__(self, plan: Plan, logprobs: bool) -> None:
        self.plan = plan
        self.served = plan.served
        self.logprobs = logprobs

    def _header(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.plan.completion_id,
            "object": obj,
            "created": self.plan.created,
            "model": self.served.name,
            "system_fingerprint": self.served.system_fingerprint,
        }

    @staticmethod
    def _logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
        return {
            "token": lp.token,
            "logprob": float(lp.logprob),
            "bytes": list(lp.token.encode("utf-8")),
            "top_logprobs": [
                {"token": token, "logprob": float(value), "bytes": list(token.encode("utf-8"))}
                for _id, token, value in lp.top
            ],
        }

    def _logprobs(self, outputs: list[RequestOutput]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [self._logprob_entry(lp) for out in outputs for lp in (out.logprobs or [])]}

    @staticmethod
    def _message(outputs: list[RequestOutput]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(o.new_text for o in outputs)}
        calls = assemble([d for o in outputs for d in _calls(o)])
        if calls:
            message["tool_calls"] = calls
            message["content"] = message["content"] or None  # OpenAI's null when there are only calls
        return message

    def full(self, outputs: dict[int, list[RequestOutput]], usage: Usage) -> dict[str, Any]:
        choices = [
            {
                "index": index,
                "message": self._message(outs),
                "logprobs": self._logprobs(outs),
                "finish_reason": _finish_reason(outs),
            }
            for index, outs in sorted(outputs.items())
        ]
        return {**self._header("chat.completion"), "choices": choices, "usage": usage.to_dict()}

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        chunk = {**self._header("chat.completion.chunk"), "choices": choices}
        if include_usage:
            chunk["usage"] = None
        return chunk

    def stream_start(self) -> list[dict[str, Any]]:
        # The role comes first, alone, as OpenAI sends it.
        return [
            self._chunk(
                [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                include_usage=False,
            )
            for c in self.plan.choices
        ]

    def stream_event(self, event: ChoiceEvent, include_usage: bool) -> dict[str, Any] | None:
        out = event.output
        if _is_empty(out):
            return None
        calls = _calls(out)
        delta: dict[str, Any] = {"content": out.new_text} if out.new_text or not (out.finished or calls) else {}
        if calls:
            delta["tool_calls"] = [d.to_dict() for d in calls]
        choice = {
            "index": event.index,
            "delta": delta,
            "logprobs": self._logprobs([out]),
            "finish_reason": out.finish_reason if out.finished else None,
        }
        return self._chunk([choice], include_usage)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._header("chat.completion.chunk"), "choices": [], "usage": usage.to_dict()}


class CompletionRenderer(OpenAIRenderer):
    """The completions API's shapes. With ``echo`` the prompt comes first (with ``logprobs``, its tokens'
    logprobs too, from the engine's first output); with ``n`` below the candidates generated per prompt
    (``best_of``), a whole answer keeps each prompt's ``n`` best (``gateway.pipeline.completions.keep_best``)."""

    def __init__(self, plan: Plan, logprobs: int | None, echo: bool, n: int | None = None) -> None:
        self.plan = plan
        self.served = plan.served
        self.logprobs = logprobs
        self.echo = echo
        self.n = n
        self._offsets: dict[int, int] = {}

    def _header(self) -> dict[str, Any]:
        return {
            "id": self.plan.completion_id,
            "object": "text_completion",
            "created": self.plan.created,
            "model": self.served.name,
            "system_fingerprint": self.served.system_fingerprint,
        }

    def _prompt_text(self, index: int) -> str:
        prompt = self.plan.prompts[self.plan.choices[index].prompt_index]
        if prompt.text is None:
            prompt.text = self.served.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        return prompt.text

    def _prompt_rows(self, index: int, scored: list[TokenLogprob | None]) -> list[_Row]:
        """The echoed prompt's tokens with their logprobs; the first has none (nothing came before it)."""
        prompt = self.plan.prompts[self.plan.choices[index].prompt_index]
        rows: list[_Row] = []
        for token_id, lp in zip(prompt.token_ids, scored):
            if lp is None:
                rows.append((self.served.tokenizer.decode([token_id], skip_special_tokens=False), None, None))
            else:
                rows.append((lp.token, float(lp.logprob), {token: float(value) for _id, token, value in lp.top}))
        return rows

    def _logprobs(self, index: int, outputs: list[RequestOutput]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        rows: list[_Row] = []
        for out in outputs:
            if self.echo and out.prompt_logprobs is not None:
                rows += self._prompt_rows(index, out.prompt_logprobs)
            rows += [(lp.token, float(lp.logprob), {token: float(value) for _id, token, value in lp.top})
                     for lp in out.logprobs or []]  # fmt: skip
        offsets: list[int] = []
        offset = self._offsets.get(index, 0)
        for token, _, _ in rows:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [r[2] for r in rows], "text_offset": offsets}  # fmt: skip

    def full(self, outputs: dict[int, list[RequestOutput]], usage: Usage) -> dict[str, Any]:
        if self.n is not None and len(self.plan.choices) > self.n * len(self.plan.prompts):
            picked = keep_best(self.plan.choices, outputs, self.n)  # best_of: usage still counts every candidate
        else:
            picked = [(index, index, outs) for index, outs in sorted(outputs.items())]
        choices = []
        for answer, index, outs in picked:
            text = "".join(o.new_text for o in outs)
            if self.echo:
                text = self._prompt_text(index) + text
            choices.append(
                {
                    "index": answer,
                    "text": text,
                    "logprobs": self._logprobs(index, outs),
                    "finish_reason": _finish_reason(outs),
                }
            )
        return {**self._header(), "choices": choices, "usage": usage.to_dict()}

    def stream_start(self) -> list[dict[str, Any]]:
        if not self.echo or self.logprobs is not None:  # with logprobs, the prompt goes with its first output
            return []
        return [
            {
                **self._header(),
                "choices": [{"index": c.index, "text": self._prompt_text(c.index), "logprobs": None, "finish_reason": None}],
            }
            for c in self.plan.choices
        ]

    def stream_event(self, event: ChoiceEvent, include_usage: bool) -> dict[str, Any] | None:
        out = event.output
        echoed = self.echo and out.prompt_logprobs is not None and self.logprobs is not None
        if _is_empty(out) and not echoed:
            return None
        chunk: dict[str, Any] = {
            **self._header(),
            "choices": [
                {
                    "index": event.index,
                    "text": (self._prompt_text(event.index) if echoed else "") + out.new_text,
                    "logprobs": self._logprobs(event.index, [out]),
                    "finish_reason": out.finish_reason if out.finished else None,
                }
            ],
        }
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._header(), "choices": [], "usage": usage.to_dict()}


_Row = tuple[str, float | None, dict[str, float] | None]  # a token's text, logprob and best alternatives
