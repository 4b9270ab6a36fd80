"""The plan of a request to a model served by an upstream fleet (backend ``openai``).

No tokenizer runs here: each choice becomes one upstream request (``n`` 1,
choice ``i`` seeded ``seed + i`` like a local model's), in the upstream's model
name, with only the fields the request set. The prompt's tokens are estimated
for the limiter and settled with the upstream's own ``usage``. What only a
local engine can do (echo, completion logprobs, token-id prompts, our
speculative decoding, best_of ranked across several choices) is refused with a reason instead of being half-done;
so is tool calling, for now (``tools`` or tool history in the messages).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import TYPE_CHECKING, Any

from inferflux.backends.engine import SamplingParams, SamplingParamsError
from inferflux.backends.openai.request import estimate_tokens
from inferflux.backends.openai.request import RemoteRequest

from inferflux.gateway.errors import InvalidRequest, UnsupportedParameter
from inferflux.gateway.pipeline.generation import ChoiceSpec
from inferflux.gateway.pipeline.plan import Placement, Plan, PreparedPrompt
from inferflux.gateway.pipeline.protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, GenerationRequest
from inferflux.gateway.pipeline.protocol import param_names

if TYPE_CHECKING:
    from inferflux.gateway.models.served import ServedModel

# What the affinity key reads of a prompt: where the part that requests share sits. A chat's key is its
# leading system messages (what one application's conversations share); without them, and for a
# completion, the first AFFINITY_CHARS characters (about 128 tokens, the first blocks of the prompt).
# A longer opening would take in each request's own question and scatter one application's requests
# (measured: benchmarks/bench_prefix_routing.py, docs/benchmarks.md).
AFFINITY_CHARS = 512
MAX_AFFINITY_CHARS = 16384  # a system prompt beyond this is keyed by its beginning
# Sampling fields sent upstream as the client set them; the names are OpenAI's
# (logit_bias with its keys still strings), and the last seven are the extensions
# vLLM, SGLang and llama.cpp read. The upstream checks and enforces them
# (response_format too, passed as the client wrote it): its grammar engine, not ours.
PASSED = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k",
          "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "guided_regex", "guided_choice")  # fmt: skip


def plan_remote(served: ServedModel, req: GenerationRequest, placement: Placement) -> Plan:
    """The plan of ``req`` for a remote model (the routes call it in place of ``plan_chat``/``plan_completion``)."""
    _refuse_local_only(req)
    prompts = _prompts(req)
    if len(prompts) * req.n > MAX_CHOICES:
        raise InvalidRequest(
            f"{len(prompts)} prompts x n={req.n} exceeds the limit of {MAX_CHOICES} choices per request", param="n"
        )
    chat = isinstance(req, ChatCompletionRequest)
    completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    upstream_model = served.engine.upstream_model
    prepared: list[PreparedPrompt] = []
    choices: list[ChoiceSpec] = []
    for p_index, (payload, text, estimate) in enumerate(prompts):
        prepared.append(PreparedPrompt(token_ids=[], text=text, estimated_tokens=estimate))
        affinity = _affinity(placement.tenant, _shared_opening(req, text))
        for sample in range(req.n):
            index = p_index * req.n + sample
            body = {"model": upstream_model, **payload, **_sampling(req, index)}
            request = RemoteRequest(
                request_id=f"{completion_id}-{index}",
                route="chat" if chat else "completion",
                body=body,
                prompt_tokens=estimate,
                params=_params(req),
                affinity=affinity,
                headers=dict(placement.upstream_headers),
                tenant=placement.tenant,
                stream=req.stream,
            )
            choices.append(ChoiceSpec(index=index, prompt_index=p_index, request=request))  # type: ignore[arg-type]
    return Plan(served=served, prompts=prepared, choices=choices, completion_id=completion_id,
                param_names=param_names(req))  # fmt: skip


def _refuse_local_only(req: GenerationRequest) -> None:
    def refuse(param: str, what: str) -> UnsupportedParameter:
        return UnsupportedParameter(f"{what} is not supported for a model served by an upstream", param=param)

    if req.speculative is not None and req.speculative.k != 0:
        raise refuse("speculative", "speculative")
    if isinstance(req, ChatCompletionRequest) and (req.tools or req.has_tool_history):
        # Not yet forwarded: the upstream's calls would have to be parsed back and their arguments guarded.
        raise refuse("tools" if req.tools else "messages", "tool calling")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise refuse("echo", "echo")
        if req.logprobs is not None:
            raise refuse("logprobs", "logprobs on the completions route")
        if req.samples > req.n > 1:
            # Each choice is one upstream request, so best_of travels upstream only for a single choice
            # (never streamed: the protocol refuses best_of with stream, and a whole answer is asked for
            # whole); ranking several here would need logprobs a remote completion does not carry.
            raise refuse("best_of", "best_of above n with n above 1")
        if any(not isinstance(p, str) for p in req.prompts()):
            raise refuse("prompt", "a prompt of token ids")


def _prompts(req: GenerationRequest) -> list[tuple[dict[str, Any], str, int]]:
    """Each prompt as (its part of the upstream body, its text for affinity and echo, its estimated tokens)."""
    if isinstance(req, ChatCompletionRequest):
        messages = req.template_messages()
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        # Each message costs a few tokens of role and turn markers besides its text.
        estimate = sum(estimate_tokens(m["content"]) + 4 for m in messages) + 2
        return [({"messages": messages}, text, estimate)]
    return [({"prompt": p}, p, estimate_tokens(p)) for p in req.prompts() if isinstance(p, str)]


def _sampling(req: GenerationRequest, index: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"n": 1}
    for name in PASSED:
        value = getattr(req, name)
        if value is not None and (name != "ignore_eos" or value):
            fields[name] = value
    if req.requested_max_tokens is not None:
        fields["max_tokens"] = req.requested_max_tokens
    if req.stop_list:
        fields["stop"] = req.stop_list
    if req.seed is not None:
        fields["seed"] = req.seed + index
    if isinstance(req, CompletionRequest) and req.samples > req.n:
        fields["best_of"] = req.best_of  # the upstream generates them and returns its best; its usage counts all
    if isinstance(req, CompletionRequest) and req.suffix:
        fields["suffix"] = req.suffix  # the upstream's model decides whether it can fill in the middle
    if req.response_format is not None:
        fields["response_format"] = req.response_format.model_dump(by_alias=True, exclude_none=True)
    if isinstance(req, ChatCompletionRequest) and req.logprobs:
        fields["logprobs"] = True
        if req.top_logprobs:
            fields["top_logprobs"] = req.top_logprobs
    return fields


def _params(req: GenerationRequest) -> SamplingParams:
    try:
        # What the limits reserve: an upstream told best_of generates that many candidates for the choice.
        most = req.requested_max_tokens
        if most is not None and req.samples > req.n:
            most *= req.samples
        return SamplingParams(max_tokens=most, stop=req.stop_list)
    except SamplingParamsError as exc:
        raise InvalidRequest(str(exc), param=exc.param) from None


def _shared_opening(req: GenerationRequest, text: str) -> str:
    """The part of a prompt that other requests of the same application likely share."""
    if isinstance(req, ChatCompletionRequest):
        leading = []
        for message in req.messages:
            if message.role not in ("system", "developer"):
                break
            leading.append(message.text())
        if leading:
            return "\n".join(leading)[:MAX_AFFINITY_CHARS]
    return text[:AFFINITY_CHARS]


def _affinity(tenant: str | None, opening: str) -> bytes:
    """Same tenant, same opening: same key, so the upstream that cached that prefix gets it again."""
    return hashlib.sha256(f"{tenant or ''}\0{opening}".encode("utf-8", "surrogatepass")).digest()
