"""``RequestPolicy``: one request's traffic policy (a generation's or an embeddings'), from its body to its settlement.

The driver (``gateway.pipeline.run``) reads body → parse → plan → policy →
generate → render; this object is the "policy": it owns everything the gateway
decides about a request between its authentication (``gateway.auth``,
``gateway.authz``) and its first output, and the accounting after its last. It
is built from the request's ``Call`` and the app's traffic policy (the limiter,
the guardrail resolver, the prices), and reads nothing else of the request. Each
step below is one method the driver calls, in this order, inside the trace stage
named beside it. The refusal order is written here and nowhere else; the first
refusal answers:

0. (the body stage, before this object) the size of the request's schemas, tools
   and guided constraints (400 ``schema_too_complex``, ``gateway.pipeline.body``):
   neither the guardrails nor the grammar engine work on what is refused for its size.
1. ``screen`` (stage ``guardrails.input``): the tenant's input guardrails, on the
   body as sent (400 ``content_filter``; a redacting rule rewrites the body the
   driver parses); for every tenant, 400 ``invalid_unicode`` for a lone surrogate
   in a history call's arguments, and for a tenant with input rules, 400
   ``token_ids_unchecked`` for token ids no tokenizer here can decode.
2. ``place`` (in stage ``plan``): the model, if the caller may use it
   (``allowed_model``: 404 as for a model that does not exist), then the
   request's priority within the bounds its traffic policy allows (400
   ``priority``), its tenant's fair-share weight, its prefix-cache namespace.
   Then (the plan stage) its grammars, compiled within the grammar budget (400
   ``schema_too_complex``, 503 ``grammar_busy``; ``gateway.pipeline.grammars``).
3. in this order:
   a. ``admit`` (stage ``limits``): the engine's queue (503 when it is full, 429
      ``tenant_queue_full`` beyond the tenant's share of it), then the rate
      limits and quotas (429, or 503 when a limit cannot be decided); a request
      refused by these is first put to every OPA policy (``authorize_all``,
      stage ``opa``), whose refusal (403) answers instead, so a client learns of
      a policy's refusal before a limit's;
   b. ``authorize_inline`` (stage ``opa``): the global OPA policies, decided
      inline (403) before the engine sees the request;
   c. ``generation``: the engine starts; ``authorize_deferred`` (stage ``opa``,
      concurrent): the tenant's and remote OPA policies decide beside its first
      step and are awaited before any output leaves (403).
   A request refused after 3a gets its reserved tokens back (``refund``); one
   allowed answers with the limits' headers (``headers``).
4. ``finish`` (the ``Generation``'s close): the real token counts are settled
   with the limiter, off the request path, also for a stream the client left.

An embeddings request takes the same steps but 2's placement (it has no priority
and shares no prefix cache): 1, the allow-list (``allowed_model``), then 3a
(``admit``: the queue counts it as one entry; its tokens are the inputs', with no
completion), then every OPA policy at once (``authorize_all``: 3b and 3c together,
as there is no engine start to overlap with), so nothing of it reaches the engine
before all of them allow; then 4 (``settle``), with the tokens the model counted.

A token count (Anthropic's ``/v1/messages/count_tokens``) takes 1, the allow-list,
then ``admit_count`` (stage ``limits``: one request to the rate limits, with no
tokens, since nothing reaches the engine: its requests and concurrency count, and
neither the engine's queue nor a token quota or budget is charged), then every OPA
policy at once (``authorize_all``, told the prompt's tokens and no completion),
then 4 (``settle``) with no tokens.

Everything the audit event says about the request's policy (the prompt and
completion texts, guardrail findings, the reasons of a refusal, the usage, the
end user the caller named) is written to the request context here, and only here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferflux.gateway.errors import EngineOverloaded, InvalidRequest, ModelNotFound, RateLimited
from inferflux.gateway.logs.redaction import redact
from inferflux.gateway.pipeline.generation import Generation
from inferflux.gateway.pipeline.plan import Placement, Plan
from inferflux.gateway.pipeline.protocol import GenerationRequest
from inferflux.gateway.pipeline.token_text import token_decoder
from inferflux.gateway.pipeline.tool_calls import ToolStream
from inferflux.gateway.tracing import TRACE_HEADERS, GuardMeter
from inferflux.policy.guardrails import Guardrails, OpaDecision, opa_input
from inferflux.policy.guardrails.screen import screen as screen_guarded
from inferflux.policy.ratelimit import Admission, Denial, Scheduling

if TYPE_CHECKING:
    from inferflux.gateway.models.served import ServedModel
    from inferflux.gateway.pipeline.call import Call
    from inferflux.gateway.pipeline.embeddings import EmbeddingPlan
    from inferflux.gateway.traffic import TrafficPolicy


@dataclass(frozen=True)
class Work:
    """What admission, the limits and OPA read of a request, whichever route planned it."""

    served: ServedModel
    sequences: int  # the entries it adds to the engine's queue
    prompt_tokens: int  # what the limits reserve (each choice's prompt counted)
    completion_tokens: int | None  # at most; None: unbounded (the limiter reserves its estimate)
    opa_prompt_tokens: int  # what OPA is told: each prompt once
    tools: tuple[str, ...] = ()  # the names of the tools the model may call

    @classmethod
    def of(cls, plan: Plan) -> Work:
        return cls(plan.served, len(plan.choices), plan.prompt_tokens, plan.requested_completion_tokens,
                   sum(p.num_tokens for p in plan.prompts), plan.tools.names if plan.tools else ())  # fmt: skip


class RequestPolicy:
    def __init__(self, call: Call, traffic: TrafficPolicy) -> None:
        self.call = call
        self.ctx = call.ctx
        self.principal = call.principal
        self.settings = call.state.settings
        self.metrics = call.state.metrics
        self.limiter = traffic.limiter
        self._resolver = traffic.guardrails
        self._prices = traffic.prices
        self._settling: set[asyncio.Task[Any]] = call.state.traffic_tasks
        self.guards: Guardrails | None = None
        self.headers: dict[str, str] = {}  # the rate-limit headers of the admitted request (read once 3 allows)
        self._work: Work | None = None  # what 3 decides on (``admit``)
        self._admission: Admission | None = None  # the limits' reservation, once 3a allows
        self._generation: Generation | None = None  # once the engine started (3c)
        self._meter: GuardMeter | None = None  # the output guardrails' time, for a traced request
        self._document: dict[str, Any] | None = None  # what OPA is told, built once

    # -- 1. input guardrails

    async def screen(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body as the tenant's input guardrails let it through (redacted, perhaps); raises on a block.
        A large body is checked off the event loop (``policy.guardrails.screen``)."""
        self.guards = guards = await self._resolver.resolve(self.principal.tenant_id)
        decode = token_decoder(self.call, body) if guards.checks_input else None
        screened = await screen_guarded(guards, body, len(await self.call.body()), decode)
        self.ctx.prompt_texts = screened.texts
        decision = screened.decision
        if decision is None:
            return body
        self._note_findings("input", decision.findings)
        if not decision.allowed:
            self.ctx.reasons += list(decision.reasons)
        decision.raise_if_blocked("input")
        return screened.body

    def _note_findings(self, direction: str, findings: Any) -> None:
        for finding in findings:
            self.ctx.findings.append((direction, finding))
            self.metrics.guardrail_findings.labels(direction, finding.type, finding.action).inc()

    # -- 2. where the engine files the request

    async def place(self, req: GenerationRequest) -> tuple[ServedModel, Placement]:
        """The model the request names, if its caller may use it; the request's priority (within its caller's
        bounds), its tenant's weight and its prefix-cache namespace.

        Without bounds any caller could outrank, and preempt, every other
        tenant's requests; by default a caller may only make its own less
        important. The prefix cache is the tenant's own unless the operator
        shares one.
        """
        served = allowed_model(self.call, req.model)
        bounds: Scheduling = await self.limiter.scheduling_for(self.principal)
        priority = bounds.default_priority
        if "priority" in req.model_fields_set:
            if not bounds.allows(req.priority):
                raise InvalidRequest(
                    f"priority must be from {bounds.min_priority} to {bounds.max_priority} for this caller "
                    "(lower is more important)",
                    param="priority",
                )
            priority = req.priority
        self.ctx.user = end_user(req.user)
        tenant = self.principal.tenant_id
        salt = f"tenant:{tenant}" if self.settings.engine.prefix_cache_per_tenant else None
        return served, Placement(priority=priority, tenant=tenant, weight=bounds.weight, cache_salt=salt,
                                 upstream_headers=self.upstream_headers())  # fmt: skip

    def upstream_headers(self) -> tuple[tuple[str, str], ...]:
        """Of the client's headers, the only ones a remote model's upstream sees (its credentials never do).
        A traced request's ``traceparent`` (and ``tracestate``) name its span instead of the client's."""
        headers, allowed = self.call.headers, self.settings.upstreams.forward_headers
        if self.ctx.trace is not None:
            ours = self.ctx.trace.headers()
            headers = {**{h: headers[h] for h in allowed if h in headers and h not in TRACE_HEADERS}, **ours}
        return tuple((h, headers[h]) for h in allowed if h in headers)

    # -- 3. admission, limits, OPA; the engine starts

    async def admit(self, plan: Plan | EmbeddingPlan) -> None:
        """3a: the engine's queue, then the limits; raises the refusal (the driver asks OPA first then). An
        embeddings request is one queue entry, its inputs' tokens and no completion."""
        if isinstance(plan, Plan):
            work = Work.of(plan)
        else:
            self.ctx.user = end_user(plan.user)
            work = Work(plan.served, 1, plan.prompt_tokens, 0, plan.prompt_tokens)
        self._work = work
        self._admit(work)
        self._admission = await self._reserve(work)
        self.headers = self._admission.headers  # the answer's, once every step of 3 allows

    async def admit_count(self, served: ServedModel, prompt_tokens: int) -> None:
        """3a for a token count: one request to the limits, none of its tokens (the engine never sees it)."""
        self._work = work = Work(served, 0, 0, 0, prompt_tokens)
        self._admission = await self._reserve(work)
        self.headers = self._admission.headers

    @property
    def decides(self) -> bool:
        """Whether any OPA policy decides this request (``authorize_all``)."""
        return bool(self._guards.engines)

    @property
    def decides_inline(self) -> bool:
        return bool(self._guards.engines and self._guards.inline_engines)

    @property
    def decides_deferred(self) -> bool:
        return bool(self._guards.engines and self._guards.deferred_engines)

    async def authorize_all(self) -> None:
        """Every OPA policy's decision, at once (for a request refused anyway, whose policy refusal answers
        first, and for an embeddings request, which has no engine start to overlap them with)."""
        self._refuse_if_denied(await self._guards.authorize(self._opa_document()))

    def authorize_inline(self) -> None:
        """3b: the global OPA policies, before the engine gets the request."""
        self._refuse_if_denied(self._guards.authorize_inline(self._opa_document()))

    async def authorize_deferred(self) -> None:
        """3c: the tenant's and remote OPA policies, awaited while the engine starts."""
        self._refuse_if_denied(await self._guards.authorize_deferred(self._opa_document()))

    async def refund(self) -> None:
        """Refused after 3a after all: abort the sequences, and give back the tokens reserved for them
        (the request itself was counted when it was admitted)."""
        if self._generation is not None:
            await self._generation.close(report=False)
        await self.limiter.settle(self._admitted.handle, 0, 0)

    # A step called out of order is a programming error, not input: these raise it.

    @property
    def _guards(self) -> Guardrails:
        if self.guards is None:
            raise RuntimeError("RequestPolicy.screen must run before step 3")
        return self.guards

    @property
    def _admitted(self) -> Admission:
        if self._admission is None:
            raise RuntimeError("RequestPolicy.admit must allow the request first")
        return self._admission

    def _admit(self, work: Work) -> None:
        """Refuse work the engine would only queue behind too much else, and a tenant's
        work beyond its share of the queue (its own flood is its own 429, not everyone's 503).
        Waiting embeddings requests count, one entry each, beside waiting sequences."""
        stats = work.served.engine.stats()
        waiting = stats.num_waiting + stats.num_waiting_embeddings
        tenant = self.principal.tenant_id
        if waiting + work.sequences > self.settings.max_queued_sequences:
            raise EngineOverloaded(
                f"The model {work.served.name!r} has {waiting} requests and sequences waiting already; retry later",
                retry_after=1,
            )
        share = self.settings.max_queued_sequences_per_tenant
        mine = stats.waiting_per_tenant.get(tenant, 0) + stats.embeddings_waiting_per_tenant.get(tenant, 0)
        if mine + work.sequences > share:
            raise RateLimited(
                f"Your tenant has {mine} requests and sequences waiting for the model {work.served.name!r} already, "
                f"its share of the queue is {share}; retry later",
                retry_after=1,
                code="tenant_queue_full",
            )

    async def _reserve(self, work: Work) -> Admission:
        """Rate limits and quotas for the request's estimated tokens; raises 429 (or 503) when refused."""
        price = await self._prices.price_for(work.served.name)  # for spend budgets
        result = await self.limiter.check_and_reserve(
            self.principal, prompt_tokens=work.prompt_tokens, max_tokens=work.completion_tokens, price=price
        )
        if isinstance(result, Denial):
            self.metrics.ratelimit_denied.labels(result.dimension.value, result.level.value).inc()
            self.ctx.reasons.append(f"rate limit: {result.dimension.value} ({result.level.value})")
            raise result.error()
        return result

    def _opa_document(self) -> dict[str, Any]:
        if self._document is None:
            if (work := self._work) is None:
                raise RuntimeError("RequestPolicy.admit must run before OPA decides")
            self._document = opa_input(
                self.principal,
                model=work.served.name,
                route=self.call.route,
                prompt_tokens=work.opa_prompt_tokens,
                max_completion_tokens=work.completion_tokens,
                findings=[f for stage, f in self.ctx.findings if stage == "input"],
                request_id=self.ctx.request_id,
                user=self.ctx.user,
                tools=work.tools,
            )
        return self._document

    def _refuse_if_denied(self, decision: OpaDecision) -> None:
        """PolicyDenied (403), or 503 when a policy failed closed, unless ``decision`` allows."""
        if not decision.allowed:
            self.ctx.reasons += list(decision.reasons)
        decision.raise_for_deny()

    def generation(self, plan: Plan) -> Generation:
        """3c: the request's ``Generation``, started (the engine has its sequences), its output checked by the
        tenant's guardrails, settled when it closes."""
        guards, model, trace = self._guards, plan.served.name, self.ctx.trace
        output_check = guards.output_stream if guards.checks_output else None
        ttft = self.metrics.ttft.labels(model)
        on_first_token = ttft.observe
        if trace is not None:  # its stages timed: the output guardrails' checks, the engine's moments
            self._meter = meter = GuardMeter()
            output_check = meter.timed(output_check) if output_check is not None else None
            on_first_token = lambda seconds: ttft.observe(seconds, trace.exemplar())  # noqa: E731
        self._generation = Generation(
            plan.served,
            plan.choices,
            param_names=plan.param_names,
            started=self.ctx.started,
            on_first_token=on_first_token,
            on_close=lambda gen: self.finish(gen, model),
            output_check=output_check,
            tool_stream=(lambda: ToolStream(tools, guards)) if (tools := plan.tools) is not None else None,
            timed=trace is not None,
        )
        self._generation.start()
        return self._generation

    # -- 4. settlement

    def finish(self, gen: Generation, model: str) -> None:
        """Record what the request used and settle it with the limiter (real counts, off the request path)."""
        self._note_findings("output", gen.output_findings)
        if (trace := self.ctx.trace) is not None:
            if (timings := gen.timings()) is not None:
                trace.engine(timings)
            if self._meter is not None:
                trace.output_checks(self._meter)
        self.ctx.completion_texts = gen.texts()
        self.ctx.tool_calls = gen.tool_names()
        self.settle(model, gen.usage.prompt_tokens, gen.usage.completion_tokens)

    def settle(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        """What the request used, counted and settled with the limiter (an embeddings request's, by the driver)."""
        self.metrics.observe_tokens(model, prompt_tokens, completion_tokens)
        self.ctx.usage = (prompt_tokens, completion_tokens)
        # Also for a stream the client left; the limiter never raises, and the
        # task is kept referenced until done.
        task = asyncio.ensure_future(self.limiter.settle(self._admitted.handle, prompt_tokens, completion_tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)


def allowed_model(call: Call, name: str) -> ServedModel:
    """The served model ``name`` names, if ``call``'s caller may use it; otherwise the same 404 as a missing one
    (a tenant learns nothing of the models it may not use). The request's context records it."""
    served = call.state.manager.get(name)
    if not call.principal.may_use_model(served.name):
        raise ModelNotFound(name)
    call.ctx.model = served.name
    return served


END_USER_CHARS = 128  # what the audit event and OPA keep of a request's ``user``


def end_user(user: str | None) -> str | None:
    """OpenAI's ``user`` as the audit event and OPA see it: at most ``END_USER_CHARS`` characters, with
    anything shaped like a credential (an API key, a JWT, a bearer token) replaced: it is the caller's
    own id for its end user, and a caller that pastes a secret there must not have it kept."""
    if not user:
        return None
    return redact(user)[:END_USER_CHARS] or None
