"""What a parsed generation request asks of the engine: its prompts, tokenised, and one checked engine request per choice.

``plan_request`` is the stage: the request's grammars compiled first
(``gateway.pipeline.grammars``), then its plan, on the event loop for a small
body and on the thread pool otherwise.

The gateway validates the API's own rules here (how many choices, which
speculative methods a model allows); everything the engine has a rule for
(sampling ranges, the prompt's tokens, the fit in the context and the KV
cache) is checked once, by the engine's ``make_request``, whose errors are
renamed to the API's parameter names (``sampling_kwargs`` translates the API's
fields to the engine's). The ``EngineRequest``s a ``Plan`` holds are what the
engine runs, unchecked from then on.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from inferflux.backends.engine import EngineRequest, InvalidRequestError, SamplingParams
from inferflux.backends.models import ChatTemplateError

from inferflux.gateway.errors import InvalidRequest
from inferflux.gateway.models.served import ServedModel
from inferflux.gateway.pipeline.completions import fim_prompt
from inferflux.gateway.pipeline.generation import ChoiceSpec, engine_error_to_gateway
from inferflux.gateway.pipeline.grammars import compile_grammars
from inferflux.gateway.pipeline.protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, GenerationRequest
from inferflux.gateway.pipeline.protocol import Req, param_names
from inferflux.gateway.pipeline.tools import ToolPlan, check_parameters, render_chat

if TYPE_CHECKING:
    from inferflux.gateway.pipeline.call import Call

# A body this small is templated and tokenised on the event loop: a few hundred
# microseconds at most, less than a hop to the thread pool and back costs on a
# busy machine (measured: benchmarks/bench_policy.py); a larger one is planned
# on the pool so that it cannot stall every other request.
INLINE_PLAN_BYTES = 1024


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    text: str | None = None  # for echo; decoded lazily when only ids were given
    estimated_tokens: int | None = None  # a remote model's prompt: counted by its upstream, estimated here

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.estimated_tokens is None else self.estimated_tokens


@dataclass(frozen=True)
class Placement:
    """Where the engine files a request: its priority, fair-share key and weight, and prefix-cache namespace."""

    priority: int = 0
    tenant: str | None = None
    weight: float = 1.0
    cache_salt: str | None = None
    upstream_headers: tuple[tuple[str, str], ...] = ()  # the client headers a remote model's upstream may see


@dataclass
class Plan:
    """What a validated request asks of the engine."""

    served: ServedModel
    prompts: list[PreparedPrompt]
    choices: list[ChoiceSpec]
    completion_id: str
    param_names: dict[str, str]  # the engine's parameter names as this API spells them
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None  # the calls the output may hold (gateway.pipeline.tool_calls parses them)

    @property
    def prompt_tokens(self) -> int:
        """Tokens the engine reads, each choice counted (what rate limits reserve)."""
        return sum(len(c.request.prompt) for c in self.choices)

    @property
    def requested_completion_tokens(self) -> int | None:
        """The completion tokens the request may use at most; None when a choice did not say."""
        limits = [c.request.params.max_tokens for c in self.choices]
        return None if any(m is None for m in limits) else sum(m for m in limits if m is not None)


async def plan_request(call: Call, served: ServedModel, req: Req, placement: Placement,
                       plan_for: Callable[[ServedModel, Req, Placement], Plan]) -> Plan:  # fmt: skip
    """``req``'s plan by ``plan_for`` (``plan_chat``, ``plan_completion``, ``plan_remote``), its grammars compiled
    first; raises the refusal (400, 503), or ``ClientDisconnected`` if the client left while they compiled."""
    await compile_grammars(call, served, req)  # in a grammar worker first, given up if the client leaves
    # Planning finds them compiled (the model's first guided request builds its vocabulary, ~0.5 s).
    if len(await call.body()) <= INLINE_PLAN_BYTES and req.guided() is None:
        return plan_for(served, req, placement)
    return await run_in_threadpool(plan_for, served, req, placement)


def plan_chat(served: ServedModel, req: ChatCompletionRequest, placement: Placement) -> Plan:
    check_parameters(req.tools or ())
    return _plan(served, req, [PreparedPrompt(encode_chat(served, req))], placement, prefix="chatcmpl")


def count_chat(served: ServedModel, req: ChatCompletionRequest) -> int:
    """The tokens of ``req``'s prompt as ``plan_chat`` makes it (a token count: nothing more is planned)."""
    if served.remote:
        raise InvalidRequest(f"The model {served.name!r} is served by an upstream, whose tokenizer this server does "
                             "not have: its tokens cannot be counted here", param="model",
                             code="model_not_supported")  # fmt: skip
    return len(encode_chat(served, req))


def plan_completion(served: ServedModel, req: CompletionRequest, placement: Placement) -> Plan:
    return _plan(served, req, encode_prompts(served, req), placement, prefix="cmpl")


def encode_chat(served: ServedModel, req: ChatCompletionRequest) -> list[int]:
    try:
        text = render_chat(served.local_tokenizer, req.template_messages(), req.prompt_tools(), req.has_tool_history)
    except ChatTemplateError as exc:
        raise InvalidRequest(f"The messages cannot be rendered with this model's chat template: {exc}", param="messages") from None
    # The template already wrote the special tokens (BOS, turn markers) as
    # text; letting the tokenizer add its own would double them.
    return served.local_tokenizer.encode(text, add_special_tokens=False)


def encode_prompts(served: ServedModel, req: CompletionRequest) -> list[PreparedPrompt]:
    raw = req.prompts()
    if len(raw) > MAX_CHOICES:
        raise InvalidRequest(f"At most {MAX_CHOICES} prompts are allowed per request", param="prompt")
    tokenizer = served.local_tokenizer
    if req.suffix:  # fill-in-the-middle: the text between the prompt and the suffix
        return [PreparedPrompt(fim_prompt(tokenizer, served.name, p, req.suffix),
                               text=p if isinstance(p, str) else None) for p in raw]  # fmt: skip
    # Token ids go to the engine as given: its check (in _plan) names a bad one.
    return [PreparedPrompt(tokenizer.encode(p), text=p) if isinstance(p, str) else PreparedPrompt(list(p))
            for p in raw]  # fmt: skip


def sampling_kwargs(
    req: GenerationRequest, *, max_tokens: int | None, num_logprobs: int | None, seed_offset: int = 0
) -> dict[str, Any]:
    """Keyword arguments for ``backends.engine.SamplingParams``.

    OpenAI's defaults (temperature 1, top_p 1) are spelled out so the result
    does not depend on the engine's own defaults. Choice ``i`` of a request
    with a seed gets ``seed + i``; otherwise ``n`` seeded samples would all be
    the same text.
    """
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "stop": req.stop_list,
        "ignore_eos": req.ignore_eos,
        "logprobs": num_logprobs is not None,
        "top_logprobs": num_logprobs or 0,
    }
    optional = {
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "min_tokens": req.min_tokens,
        "seed": None if req.seed is None else req.seed + seed_offset,
        "speculative_k": None if req.speculative is None else req.speculative.k,
        "logit_bias": req.token_logit_bias,
        "guided": req.guided(),
        "prompt_logprobs": req.prompt_logprobs,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs


def _plan(
    served: ServedModel, req: GenerationRequest, prompts: list[PreparedPrompt], placement: Placement, *, prefix: str
) -> Plan:
    samples = req.samples  # best_of candidates per prompt, when given
    if len(prompts) * samples > MAX_CHOICES:
        what = "n" if samples == req.n else "best_of"
        raise InvalidRequest(
            f"{len(prompts)} prompts x {what}={samples} exceeds the limit of {MAX_CHOICES} choices per request",
            param=what,
        )
    _check_speculative(served, req)
    # Candidates are ranked by their logprobs (gateway.pipeline.completions.keep_best), asked for or not.
    num_logprobs = req.num_logprobs if samples == req.n or req.num_logprobs is not None else 0
    names = param_names(req)
    completion_id = f"{prefix}-{secrets.token_hex(12)}"
    choices: list[ChoiceSpec] = []
    for p_index, prompt in enumerate(prompts):
        # A bad prompt among several is named by its index.
        prompt_names = names if len(prompts) == 1 else {**names, "prompt": f"prompt[{p_index}]"}
        for sample in range(samples):
            index = p_index * samples + sample
            # max_tokens None: until the context or the KV cache is full (the engine resolves it).
            kwargs = sampling_kwargs(req, max_tokens=req.requested_max_tokens, num_logprobs=num_logprobs,
                                     seed_offset=index)  # fmt: skip
            request = _engine_request(served, f"{completion_id}-{index}", prompt.token_ids, kwargs, placement,
                                      prompt_names)  # fmt: skip
            choices.append(ChoiceSpec(index=index, prompt_index=p_index, request=request))
    tools = req.tool_plan if isinstance(req, ChatCompletionRequest) else None
    return Plan(served=served, prompts=prompts, choices=choices, completion_id=completion_id, param_names=names,
                tools=tools)  # fmt: skip


def _engine_request(
    served: ServedModel, request_id: str, prompt: list[int], kwargs: dict[str, Any], placement: Placement,
    names: dict[str, str],
) -> EngineRequest:
    try:
        return served.engine.make_request(
            request_id, prompt, SamplingParams(**kwargs), placement.priority,
            cache_salt=placement.cache_salt, tenant=placement.tenant, weight=placement.weight,
        )
    except InvalidRequestError as exc:
        raise engine_error_to_gateway(exc, param_names=names) from None


def _check_speculative(served: ServedModel, req: GenerationRequest) -> None:
    wanted, configured = req.speculative, served.speculative
    if wanted is None or wanted.k == 0:
        return
    if configured is None:
        raise InvalidRequest(f"speculative decoding is not enabled for the model {served.name!r}", param="speculative")
    if wanted.method is not None and wanted.method != configured.method:
        raise InvalidRequest(f"speculative decoding by {wanted.method} is not enabled for the model "
                             f"{served.name!r} (it uses {configured.method})", param="speculative")
