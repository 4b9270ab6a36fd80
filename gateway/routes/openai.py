"""OpenAI-compatible routes: chat completions, completions, models."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from backends.engine import RequestOutput, SamplingParams, SamplingParamsError, TokenLogprob
from backends.models import ChatTemplateError

from gateway.authz import principal_of, requires
from gateway.context import get_context
from gateway.errors import (
    ContextLengthExceeded,
    EngineOverloaded,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    RateLimited,
    UnsupportedMediaType,
    error_body,
)
from gateway.jsonbody import decode_json_body
from gateway.generation import ChoiceEvent, ChoiceSpec, Generation, Usage, engine_error_to_gateway
from gateway.metrics import CLIENT_CLOSED_STATUS, GatewayMetrics
from gateway.models import ModelManager, ServedModel
from gateway.openapi import document
from gateway.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    sampling_kwargs,
)
from gateway.streaming import (
    SSE_DONE,
    ClientDisconnected,
    SSEResponse,
    drain_deadline,
    run_until_disconnect,
    sse_event,
)
from policy.errors import ApiError
from policy.guardrails import Guardrails, OpaDecision, opa_input, request_texts, with_texts
from policy.ratelimit import Admission, Denial, Scheduling
from policy.rbac import Scope

# -- request plumbing ---------------------------------------------------------


async def read_json(request: Request) -> dict[str, Any]:
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type must be application/json, not {media_type or 'empty'!r}")
    limits = request.app.state.settings.input_limits.json_limits()
    return decode_json_body(await request.body(), limits)


def _manager(request: Request) -> ModelManager:
    return request.app.state.manager  # type: ignore[no-any-return]


def _resolve(request: Request, name: str) -> ServedModel:
    """The served model, if this caller may use it; otherwise the same 404 as a missing one."""
    served = _manager(request).get(name)
    if not principal_of(request).may_use_model(served.name):
        raise ModelNotFound(name)
    get_context(request).model = served.name
    return served


def _metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


def _client_closed() -> Response:
    return Response(status_code=CLIENT_CLOSED_STATUS)


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    text: str | None = None  # for echo; decoded lazily when only ids were given


@dataclass
class Plan:
    """What a validated request asks of the engine."""

    served: ServedModel
    prompts: list[PreparedPrompt]
    choices: list[ChoiceSpec]
    completion_id: str
    created: int = field(default_factory=lambda: int(time.time()))


def _param_names(req: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """Engine parameter names that the API spells differently."""
    if isinstance(req, CompletionRequest):
        return {"top_logprobs": "logprobs"}
    return {"max_tokens": _max_tokens_param(req)}


def _sampling_params(
    req: ChatCompletionRequest | CompletionRequest, served: ServedModel, kwargs: dict[str, Any]
) -> SamplingParams:
    wanted, configured = req.speculative, served.speculative
    if wanted is not None and wanted.k != 0:
        if configured is None:
            raise InvalidRequest(f"speculative decoding is not enabled for the model {served.name!r}",
                                 param="speculative")
        if wanted.method is not None and wanted.method != configured.method:
            raise InvalidRequest(f"speculative decoding by {wanted.method} is not enabled for the model "
                                 f"{served.name!r} (it uses {configured.method})", param="speculative")
    try:
        params = SamplingParams(**kwargs)
        params.validate(served.info.vocab_size)
    except SamplingParamsError as exc:
        raise engine_error_to_gateway(exc, param_names=_param_names(req)) from None
    return params


def _plan(
    served: ServedModel,
    req: ChatCompletionRequest | CompletionRequest,
    prompts: list[PreparedPrompt],
    *,
    prefix: str,
    prompt_param: str,
) -> Plan:
    if len(prompts) * req.n > MAX_CHOICES:
        raise InvalidRequest(
            f"{len(prompts)} prompts x n={req.n} exceeds the limit of {MAX_CHOICES} choices per request",
            param="n",
        )
    context = served.max_model_len
    requested = req.requested_max_tokens
    completion_id = f"{prefix}-{secrets.token_hex(12)}"
    choices: list[ChoiceSpec] = []
    for p_index, prompt in enumerate(prompts):
        n_prompt = len(prompt.token_ids)
        if n_prompt == 0:
            raise InvalidRequest("The prompt is empty", param=prompt_param)
        room = context - n_prompt
        if room <= 0:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens, and the prompt has "
                f"{n_prompt}, which leaves no room for a completion. Please shorten the prompt.",
                param=prompt_param,
            )
        if requested is not None and requested > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} for the completion). "
                "Please reduce the prompt or the completion length.",
                param=_max_tokens_param(req),
            )
        for sample in range(req.n):
            index = p_index * req.n + sample
            # max_tokens None: until the context or the KV cache is full (the engine resolves it).
            kwargs = sampling_kwargs(req, max_tokens=requested, num_logprobs=req.num_logprobs, seed_offset=index)
            choices.append(
                ChoiceSpec(
                    index=index,
                    prompt_index=p_index,
                    prompt_token_ids=prompt.token_ids,
                    params=_sampling_params(req, served, kwargs),
                    request_id=f"{completion_id}-{index}",
                )
            )
    return Plan(served=served, prompts=prompts, choices=choices, completion_id=completion_id)


def _max_tokens_param(req: ChatCompletionRequest | CompletionRequest) -> str:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def _admit(request: Request, plan: Plan) -> None:
    """Refuse work the engine would only queue behind too much else, and a tenant's
    work beyond its share of the queue (its own flood is its own 429, not everyone's 503)."""
    settings = request.app.state.settings
    stats = plan.served.engine.stats()
    if stats.num_waiting + len(plan.choices) > settings.max_queued_sequences:
        raise EngineOverloaded(
            f"The model {plan.served.name!r} has {stats.num_waiting} sequences waiting already; retry later",
            retry_after=1,
        )
    mine = stats.waiting_per_tenant.get(principal_of(request).tenant_id, 0)
    if mine + len(plan.choices) > settings.max_queued_sequences_per_tenant:
        raise RateLimited(
            f"Your tenant has {mine} sequences waiting for the model {plan.served.name!r} already, "
            f"its share of the queue is {settings.max_queued_sequences_per_tenant}; retry later",
            retry_after=1,
            code="tenant_queue_full",
        )


# -- traffic policy: guardrails, OPA, rate limits ----------------------------------


async def _guard_input(request: Request, body: dict[str, Any]) -> tuple[dict[str, Any], Guardrails]:
    """The tenant's guardrails and the body as they let it through (redacted, perhaps); raises on a block."""
    ctx = get_context(request)
    guards = await request.app.state.guardrails.resolve(principal_of(request).tenant_id)
    ctx.prompt_texts = request_texts(body)
    if not guards.checks_input:
        return body, guards
    decision = guards.check_input(ctx.prompt_texts)
    _note_findings(request, "input", decision.findings)
    if not decision.allowed:
        ctx.reasons += list(decision.reasons)
    decision.raise_if_blocked("input")
    if decision.redacted:
        body = with_texts(body, list(decision.texts))
        ctx.prompt_texts = list(decision.texts)
    return body, guards


def _note_findings(request: Request, direction: str, findings: Any) -> None:
    ctx, metrics = get_context(request), _metrics(request)
    for finding in findings:
        ctx.findings.append((direction, finding))
        metrics.guardrail_findings.labels(direction, finding.type, finding.action).inc()


def _opa_document(request: Request, plan: Plan) -> dict[str, Any]:
    ctx = get_context(request)
    return opa_input(
        principal_of(request),
        model=plan.served.name,
        route=request.url.path,
        prompt_tokens=sum(len(p.token_ids) for p in plan.prompts),
        max_completion_tokens=_requested_completion_tokens(plan),
        findings=[f for stage, f in ctx.findings if stage == "input"],
        request_id=ctx.request_id,
    )


def _refuse_if_denied(request: Request, decision: OpaDecision) -> None:
    """PolicyDenied (403), or 503 when a policy failed closed, unless ``decision`` allows."""
    if not decision.allowed:
        get_context(request).reasons += list(decision.reasons)
    decision.raise_for_deny()


async def _authorize_all(request: Request, plan: Plan, guards: Guardrails) -> None:
    """Every OPA policy's decision, at once (for a request refused anyway, whose policy refusal answers first)."""
    if guards.engines:
        _refuse_if_denied(request, await guards.authorize(_opa_document(request, plan)))


def _authorize_deferred(
    request: Request, document: dict[str, Any] | None, guards: Guardrails
) -> asyncio.Future[OpaDecision] | None:
    """Start asking the tenant's awaited OPA policies (pool, remote) about the request; None if it has none.

    Started once the engine has the request, the decision runs beside the
    engine's first step and is awaited (``_authorized``) before any output
    leaves, so a policy costs the request no time unless it takes longer than
    that step. (The inline policies decided before the engine started.)
    """
    if document is None or not guards.deferred_engines:
        return None
    return asyncio.ensure_future(guards.authorize_deferred(document))


async def _authorized(request: Request, verdict: asyncio.Future[OpaDecision] | None) -> None:
    """Wait for the awaited OPA policies' decision; raises unless it allows."""
    if verdict is not None:
        _refuse_if_denied(request, await verdict)


def _requested_completion_tokens(plan: Plan) -> int | None:
    limits = [c.params.max_tokens for c in plan.choices]
    return None if any(m is None for m in limits) else sum(m for m in limits if m is not None)


async def _reserve(request: Request, plan: Plan) -> Admission:
    """Rate limits and quotas for the request's estimated tokens; raises 429 (or 503) when refused."""
    result = await request.app.state.limiter.check_and_reserve(
        principal_of(request),
        prompt_tokens=sum(len(c.prompt_token_ids) for c in plan.choices),
        max_tokens=_requested_completion_tokens(plan),
    )
    if isinstance(result, Denial):
        _metrics(request).ratelimit_denied.labels(result.dimension.value, result.level.value).inc()
        get_context(request).reasons.append(f"rate limit: {result.dimension.value} ({result.level.value})")
        raise result.error()
    return result


async def _scheduling(request: Request, req: ChatCompletionRequest | CompletionRequest) -> tuple[int, float]:
    """The request's engine priority, within the bounds the caller's traffic policy
    allows (400 ``priority`` outside them), and its tenant's weight.

    Without bounds any caller could outrank, and preempt, every other tenant's
    requests; by default a caller may only make its own less important.
    """
    bounds: Scheduling = await request.app.state.limiter.scheduling_for(principal_of(request))
    if "priority" not in req.model_fields_set:
        return bounds.default_priority, bounds.weight
    if not bounds.allows(req.priority):
        raise InvalidRequest(
            f"priority must be from {bounds.min_priority} to {bounds.max_priority} for this caller "
            "(lower is more important)",
            param="priority",
        )
    return req.priority, bounds.weight


def _generation(
    request: Request,
    plan: Plan,
    req: ChatCompletionRequest | CompletionRequest,
    guards: Guardrails,
    admission: Admission,
    scheduling: tuple[int, float],
) -> Generation:
    metrics = _metrics(request)
    model = plan.served.name
    limiter = request.app.state.limiter
    ctx = get_context(request)
    settling: set[asyncio.Task[None]] = request.app.state.traffic_tasks

    def record(usage: Usage) -> None:
        metrics.observe_tokens(model, usage.prompt_tokens, usage.completion_tokens)
        ctx.usage = (usage.prompt_tokens, usage.completion_tokens)
        _note_findings(request, "output", gen.output_findings)
        ctx.completion_texts = gen.texts()
        # The real counts, also for a stream the client left: settled off the
        # request path (the limiter never raises), and kept referenced until done.
        task = asyncio.ensure_future(limiter.settle(admission.handle, usage.prompt_tokens, usage.completion_tokens))
        settling.add(task)
        task.add_done_callback(settling.discard)

    priority, weight = scheduling
    gen = Generation(
        plan.served,
        plan.choices,
        priority=priority,
        tenant=principal_of(request).tenant_id,
        weight=weight,
        param_names=_param_names(req),
        started=ctx.started,
        on_first_token=lambda seconds: metrics.ttft.labels(model).observe(seconds),
        on_close=record,
        output_check=guards.output_stream if guards.checks_output else None,
        cache_salt=_cache_salt(request),
    )
    return gen


def _cache_salt(request: Request) -> str | None:
    """The prefix-cache namespace of the caller: its tenant's own, unless the operator shares one."""
    if not request.app.state.settings.engine.prefix_cache_per_tenant:
        return None
    return f"tenant:{principal_of(request).tenant_id}"


async def _collect(gen: Generation) -> dict[int, list[RequestOutput]]:
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


async def _stream_or_collect(
    request: Request,
    plan: Plan,
    req: ChatCompletionRequest | CompletionRequest,
    render: Renderer,
    guards: Guardrails,
) -> Response:
    scheduling = await _scheduling(request, req)
    try:
        _admit(request, plan)
        admission = await _reserve(request, plan)
    except ApiError:
        await _authorize_all(request, plan, guards)  # a policy's refusal answers first
        raise
    document = _opa_document(request, plan) if guards.engines else None
    gen: Generation | None = None
    try:
        if document is not None and guards.inline_engines:
            _refuse_if_denied(request, guards.authorize_inline(document))  # before the engine gets it
        gen = _generation(request, plan, req, guards, admission, scheduling)
        # The engine starts, the awaited policies decide while it works, and none of
        # its output goes out before they allow.
        gen.start()
        await _authorized(request, _authorize_deferred(request, document, guards))
    except BaseException:
        # Refused after all: abort the sequences, and give back the tokens reserved
        # for them (the request itself was counted when it was admitted).
        if gen is not None:
            await gen.close(report=False)
        await request.app.state.limiter.settle(admission.handle, 0, 0)
        raise
    if not req.stream:
        try:
            async with gen:
                outputs = await run_until_disconnect(request.receive, _collect(gen), drain_deadline(request.scope))
        except ClientDisconnected:
            return _client_closed()
        return JSONResponse(render.full(outputs, gen.usage), headers=admission.headers)

    try:
        # Wait for the first output before sending headers, so that admission
        # errors (prompt too long, overload) still get their real status.
        first = await run_until_disconnect(request.receive, _first_event(gen), drain_deadline(request.scope))
    except ClientDisconnected:
        await gen.close()
        return _client_closed()
    except BaseException:
        await gen.close()
        raise
    return SSEResponse(_sse_body(gen, first, render, req.include_usage), on_close=gen.close, headers=admission.headers)


async def _first_event(gen: Generation) -> ChoiceEvent | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


def _is_empty(out: RequestOutput) -> bool:
    # The engine may hold back text (an incomplete UTF-8 sequence, a possible
    # stop string); a chunk with nothing in it is noise for clients.
    return not out.new_text and not out.finished and not out.logprobs


async def _sse_body(
    gen: Generation, first: ChoiceEvent | None, render: Renderer, include_usage: bool
) -> AsyncIterator[bytes]:
    for chunk in render.stream_start():
        yield sse_event(chunk)
    try:
        if first is not None:
            chunk = render.stream_event(first, include_usage)
            if chunk is not None:
                yield sse_event(chunk)
            async for event in gen:
                chunk = render.stream_event(event, include_usage)
                if chunk is not None:
                    yield sse_event(chunk)
    except GatewayError as exc:
        # Headers are gone already; the error travels in the stream, as OpenAI does.
        yield sse_event(error_body(exc))
        yield SSE_DONE
        return
    if include_usage:
        yield sse_event(render.usage_chunk(gen.usage))
    yield SSE_DONE


# -- rendering ----------------------------------------------------------------


def _finish_reason(outputs: list[RequestOutput]) -> str | None:
    return outputs[-1].finish_reason if outputs and outputs[-1].finished else None


class _ChatRenderer:
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

    def full(self, outputs: dict[int, list[RequestOutput]], usage: Usage) -> dict[str, Any]:
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": "".join(o.new_text for o in outs)},
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
        delta: dict[str, Any] = {"content": out.new_text} if out.new_text or not out.finished else {}
        choice = {
            "index": event.index,
            "delta": delta,
            "logprobs": self._logprobs([out]),
            "finish_reason": out.finish_reason if out.finished else None,
        }
        return self._chunk([choice], include_usage)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._header("chat.completion.chunk"), "choices": [], "usage": usage.to_dict()}


class _CompletionRenderer:
    def __init__(self, plan: Plan, logprobs: int | None, echo: bool) -> None:
        self.plan = plan
        self.served = plan.served
        self.logprobs = logprobs
        self.echo = echo
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

    def _logprobs(self, index: int, outputs: list[RequestOutput]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top: list[dict[str, float]] = []
        offsets: list[int] = []
        offset = self._offsets.get(index, 0)
        for out in outputs:
            for lp in out.logprobs or []:
                tokens.append(lp.token)
                token_logprobs.append(float(lp.logprob))
                top.append({token: float(value) for _id, token, value in lp.top})
                offsets.append(offset)
                offset += len(lp.token)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def full(self, outputs: dict[int, list[RequestOutput]], usage: Usage) -> dict[str, Any]:
        choices = []
        for index, outs in sorted(outputs.items()):
            text = "".join(o.new_text for o in outs)
            if self.echo:
                text = self._prompt_text(index) + text
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": self._logprobs(index, outs),
                    "finish_reason": _finish_reason(outs),
                }
            )
        return {**self._header(), "choices": choices, "usage": usage.to_dict()}

    def stream_start(self) -> list[dict[str, Any]]:
        if not self.echo:
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
        if _is_empty(out):
            return None
        chunk: dict[str, Any] = {
            **self._header(),
            "choices": [
                {
                    "index": event.index,
                    "text": out.new_text,
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


# -- handlers -----------------------------------------------------------------


@document("Chat completion (OpenAI-compatible; SSE when stream is true)", tag="openai", body=ChatCompletionRequest, streams=True)
@requires(Scope.GENERATE)
async def chat_completions(request: Request) -> Response:
    body, guards = await _guard_input(request, await read_json(request))
    req = parse_request(ChatCompletionRequest, body, request.app.state.settings.input_limits.stop_limits())
    served = _resolve(request, req.model)
    token_ids = await run_in_threadpool(_encode_chat, served, req)
    plan = _plan(served, req, [PreparedPrompt(token_ids)], prefix="chatcmpl", prompt_param="messages")
    return await _stream_or_collect(request, plan, req, _ChatRenderer(plan, req.logprobs), guards)


def _encode_chat(served: ServedModel, req: ChatCompletionRequest) -> list[int]:
    try:
        text = served.tokenizer.apply_chat_template(req.template_messages(), add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise InvalidRequest(f"The messages cannot be rendered with this model's chat template: {exc}", param="messages") from None
    # The template already wrote the special tokens (BOS, turn markers) as
    # text; letting the tokenizer add its own would double them.
    return served.tokenizer.encode(text, add_special_tokens=False)


@document("Text completion (OpenAI-compatible; SSE when stream is true)", tag="openai", body=CompletionRequest, streams=True)
@requires(Scope.GENERATE)
async def completions(request: Request) -> Response:
    body, guards = await _guard_input(request, await read_json(request))
    req = parse_request(CompletionRequest, body, request.app.state.settings.input_limits.stop_limits())
    served = _resolve(request, req.model)
    prompts = await run_in_threadpool(_encode_prompts, served, req)
    plan = _plan(served, req, prompts, prefix="cmpl", prompt_param="prompt")
    return await _stream_or_collect(request, plan, req, _CompletionRenderer(plan, req.logprobs, req.echo), guards)


def _encode_prompts(served: ServedModel, req: CompletionRequest) -> list[PreparedPrompt]:
    vocab = served.info.vocab_size
    prepared: list[PreparedPrompt] = []
    raw = req.prompts()
    if len(raw) > MAX_CHOICES:
        raise InvalidRequest(f"At most {MAX_CHOICES} prompts are allowed per request", param="prompt")
    for i, prompt in enumerate(raw):
        if isinstance(prompt, str):
            prepared.append(PreparedPrompt(served.tokenizer.encode(prompt), text=prompt))
            continue
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
            raise InvalidRequest(f"Token id {bad} is outside the vocabulary (0..{vocab - 1})", param=where)
        prepared.append(PreparedPrompt(list(prompt)))
    return prepared


def _model_card(served: ServedModel) -> dict[str, Any]:
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "inferflux",
        # Extensions; OpenAI clients ignore unknown fields.
        "aliases": list(served.aliases),
        "context_length": served.max_model_len,
        "backend": served.backend,
    }


@document("The models this caller may use", tag="openai")
@requires(Scope.READ)
async def list_models(request: Request) -> Response:
    principal = principal_of(request)
    cards = [_model_card(m) for m in _manager(request).list() if principal.may_use_model(m.name)]
    return JSONResponse({"object": "list", "data": cards})


@document("One model, by name or alias", tag="openai")
@requires(Scope.READ)
async def retrieve_model(request: Request) -> Response:
    return JSONResponse(_model_card(_resolve(request, request.path_params["model_id"])))


def routes() -> list[BaseRoute]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        # :path so ids containing "/" (e.g. "org/model") resolve.
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    ]
