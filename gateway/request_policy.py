"""``RequestPolicy``: one generation request's traffic policy, from its body to its settlement.

The generation routes read parse → plan → policy → generate → render; this
object is the "policy": it owns everything the gateway decides about a request
between its authentication (``gateway.auth``, ``gateway.authz``) and its first
output, and the accounting after its last. The refusal order is written here
and nowhere else; the first refusal answers:

1. ``screen``: the tenant's input guardrails, on the body as sent (400
   ``content_filter``; a redacting rule rewrites the body the route parses).
2. ``place``: the request's priority within the bounds its traffic policy
   allows (400 ``priority``), its tenant's fair-share weight, its prefix-cache
   namespace.
3. ``start``, in this order:
   a. the engine's queue (503 when it is full, 429 ``tenant_queue_full``
      beyond the tenant's share of it), then the rate limits and quotas
      (429, or 503 when a limit cannot be decided); a request refused by
      these is first put to every OPA policy, whose refusal (403) answers
      instead, so a client learns of a policy's refusal before a limit's;
   b. the global OPA policies, decided inline (403) before the engine sees
      the request;
   c. the engine starts; the tenant's and remote OPA policies decide beside
      its first step and are awaited before any output leaves (403).
   A request refused after its tokens were reserved gets them back.
4. ``finish`` (the ``Generation``'s close): the real token counts are settled
   with the limiter, off the request path, also for a stream the client left.

Everything the audit event says about the request's policy (the prompt and
completion texts, guardrail findings, the reasons of a refusal, the usage) is
written to the request context here, and only here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.requests import Request

from gateway.authz import principal_of
from gateway.context import RequestContext, get_context
from gateway.errors import EngineOverloaded, InvalidRequest, RateLimited
from gateway.generation import Generation
from gateway.metrics import GatewayMetrics
from gateway.plan import GenerationRequest, Placement, Plan
from gateway.state import state_of
from policy.errors import ApiError
from policy.guardrails import Guardrails, OpaDecision, opa_input, request_texts, with_texts
from policy.ratelimit import Admission, Denial, RateLimiter, Scheduling


class RequestPolicy:
    def __init__(self, request: Request) -> None:
        state = state_of(request)
        self.request = request
        self.ctx: RequestContext = get_context(request)
        self.principal = principal_of(request)
        self.settings = state.settings
        self.limiter: RateLimiter = state.limiter
        self.metrics: GatewayMetrics = state.metrics
        self._resolver = state.guardrails
        self._settling: set[asyncio.Task[None]] = state.traffic_tasks
        self.guards: Guardrails | None = None
        self.headers: dict[str, str] = {}  # the rate-limit headers of the admitted request (set by ``start``)

    # -- 1. input guardrails

    async def screen(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body as the tenant's input guardrails let it through (redacted, perhaps); raises on a block."""
        self.guards = guards = await self._resolver.resolve(self.principal.tenant_id)
        self.ctx.prompt_texts = request_texts(body)
        if not guards.checks_input:
            return body
        decision = guards.check_input(self.ctx.prompt_texts)
        self._note_findings("input", decision.findings)
        if not decision.allowed:
            self.ctx.reasons += list(decision.reasons)
        decision.raise_if_blocked("input")
        if decision.redacted:
            body = with_texts(body, list(decision.texts))
            self.ctx.prompt_texts = list(decision.texts)
        return body

    def _note_findings(self, direction: str, findings: Any) -> None:
        for finding in findings:
            self.ctx.findings.append((direction, finding))
            self.metrics.guardrail_findings.labels(direction, finding.type, finding.action).inc()

    # -- 2. where the engine files the request

    async def place(self, req: GenerationRequest) -> Placement:
        """The request's priority (within its caller's bounds), its tenant's weight and its prefix-cache namespace.

        Without bounds any caller could outrank, and preempt, every other
        tenant's requests; by default a caller may only make its own less
        important. The prefix cache is the tenant's own unless the operator
        shares one.
        """
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
        tenant = self.principal.tenant_id
        salt = f"tenant:{tenant}" if self.settings.engine.prefix_cache_per_tenant else None
        # Of the client's headers only these reach a remote model's upstream (its credentials never do).
        headers = self.request.headers
        forwarded = tuple((h, headers[h]) for h in self.settings.upstreams.forward_headers if h in headers)
        return Placement(priority=priority, tenant=tenant, weight=bounds.weight, cache_salt=salt,
                         upstream_headers=forwarded)  # fmt: skip

    # -- 3. admission, limits, OPA; the engine starts

    async def start(self, plan: Plan) -> Generation:
        """The request's ``Generation``, started once every policy allows it; raises the first refusal."""
        try:
            self._admit(plan)
            admission = await self._reserve(plan)
        except ApiError:
            await self._authorize_all(plan)  # a policy's refusal answers first
            raise
        guards = self._guards
        document = self._opa_document(plan) if guards.engines else None
        gen: Generation | None = None
        try:
            if document is not None and guards.inline_engines:
                self._refuse_if_denied(guards.authorize_inline(document))  # before the engine gets it
            gen = self._generation(plan, admission)
            # The engine starts, the awaited policies decide while it works, and none of
            # its output goes out before they allow.
            gen.start()
            if document is not None and guards.deferred_engines:
                self._refuse_if_denied(await guards.authorize_deferred(document))
        except BaseException:
            # Refused after all: abort the sequences, and give back the tokens reserved
            # for them (the request itself was counted when it was admitted).
            if gen is not None:
                await gen.close(report=False)
            await self.limiter.settle(admission.handle, 0, 0)
            raise
        self.headers = admission.headers
        return gen

    @asynccontextmanager
    async def generating(self, plan: Plan) -> AsyncIterator[Generation]:
        """``start``, and ``finish`` when the block ends: for an answer given whole."""
        gen = await self.start(plan)
        async with gen:
            yield gen

    @property
    def _guards(self) -> Guardrails:
        if self.guards is None:
            raise RuntimeError("RequestPolicy.screen must run before start")  # a programming error, not input
        return self.guards

    def _admit(self, plan: Plan) -> None:
        """Refuse work the engine would only queue behind too much else, and a tenant's
        work beyond its share of the queue (its own flood is its own 429, not everyone's 503)."""
        stats = plan.served.engine.stats()
        wanted = len(plan.choices)
        if stats.num_waiting + wanted > self.settings.max_queued_sequences:
            raise EngineOverloaded(
                f"The model {plan.served.name!r} has {stats.num_waiting} sequences waiting already; retry later",
                retry_after=1,
            )
        share = self.settings.max_queued_sequences_per_tenant
        mine = stats.waiting_per_tenant.get(self.principal.tenant_id, 0)
        if mine + wanted > share:
            raise RateLimited(
                f"Your tenant has {mine} sequences waiting for the model {plan.served.name!r} already, "
                f"its share of the queue is {share}; retry later",
                retry_after=1,
                code="tenant_queue_full",
            )

    async def _reserve(self, plan: Plan) -> Admission:
        """Rate limits and quotas for the request's estimated tokens; raises 429 (or 503) when refused."""
        result = await self.limiter.check_and_reserve(
            self.principal, prompt_tokens=plan.prompt_tokens, max_tokens=plan.requested_completion_tokens
        )
        if isinstance(result, Denial):
            self.metrics.ratelimit_denied.labels(result.dimension.value, result.level.value).inc()
            self.ctx.reasons.append(f"rate limit: {result.dimension.value} ({result.level.value})")
            raise result.error()
        return result

    def _opa_document(self, plan: Plan) -> dict[str, Any]:
        return opa_input(
            self.principal,
            model=plan.served.name,
            route=self.request.url.path,
            prompt_tokens=sum(p.num_tokens for p in plan.prompts),
            max_completion_tokens=plan.requested_completion_tokens,
            findings=[f for stage, f in self.ctx.findings if stage == "input"],
            request_id=self.ctx.request_id,
        )

    async def _authorize_all(self, plan: Plan) -> None:
        """Every OPA policy's decision, at once (for a request refused anyway, whose policy refusal answers first)."""
        if self._guards.engines:
            self._refuse_if_denied(await self._guards.authorize(self._opa_document(plan)))

    def _refuse_if_denied(self, decision: OpaDecision) -> None:
        """PolicyDenied (403), or 503 when a policy failed closed, unless ``decision`` allows."""
        if not decision.allowed:
            self.ctx.reasons += list(decision.reasons)
        decision.raise_for_deny()

    def _generation(self, plan: Plan, admission: Admission) -> Generation:
        guards, model = self._guards, plan.served.name
        return Generation(
            plan.served,
            plan.choices,
            param_names=plan.param_names,
            started=self.ctx.started,
            on_first_token=self.metrics.ttft.labels(model).observe,
            on_close=lambda gen: self._finish(gen, model, admission),
            output_check=guards.output_stream if guards.checks_output else None,
        )

    # -- 4. settlement

    def _finish(self, gen: Generation, model: str, admission: Admission) -> None:
        """Record what the request used and settle it with the limiter (real counts, off the request path)."""
        usage = gen.usage
        self.metrics.observe_tokens(model, usage.prompt_tokens, usage.completion_tokens)
        self.ctx.usage = (usage.prompt_tokens, usage.completion_tokens)
        self._note_findings("output", gen.output_findings)
        self.ctx.completion_texts = gen.texts()
        # Also for a stream the client left; the limiter never raises, and the
        # task is kept referenced until done.
        task = asyncio.ensure_future(self.limiter.settle(admission.handle, usage.prompt_tokens, usage.completion_tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
