"""``POST /v1/embeddings``: the request, its plan, running it and the answer, in OpenAI's shape.

The driver (``gateway.pipeline.run.embeddings``) reads like the generation
routes: parse → plan → policy → embed → render, with the policy chain of
``RequestPolicy`` (input guardrails on the body, the model allow-list,
admission, limits on the input tokens with no completion, OPA, audit).

- ``input`` is a string, a list of strings, a list of token ids or a list of
  token-id lists: at most ``MAX_INPUTS`` inputs and ``MAX_TOTAL_TOKENS``
  tokens in all (OpenAI's limits), none empty (as OpenAI refuses ``""``), each
  within the model's context. Errors name the input: ``input[3]``, or
  ``input`` for a single one. Token ids are a local model's own ids, taken only
  from a model configured ``embedding.token_ids`` (400 ``token_ids_not_enabled``
  otherwise): a client's ids are usually another tokenizer's, and read as this
  model's they embed other text without any error.
- A local model pools its final hidden states as its ``embedding`` settings
  say (``mean`` by default, or ``last``), L2-normalised unless configured
  otherwise; ``dimensions`` shortens vectors only for a model configured as
  ``matryoshka`` (trained so that a prefix of its vector is an embedding),
  and is otherwise refused, unless it names the model's own size: cutting the
  vector of a model not trained for it gives a vector that means nothing.
- A model served by an upstream (backend ``openai``) is forwarded to the
  fleet's ``/embeddings`` with the same inputs; the upstream decides pooling and
  ``dimensions``, and its ``usage`` settles the tokens (estimated before).
- ``encoding_format`` ``base64`` is the vector's little-endian float32 bytes,
  as OpenAI's clients decode it; ``float`` (the default) is a list of numbers.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from inferflux.backends.engine import EmbeddingRequest, EmbeddingResult, EmbeddingsUnsupportedError, EngineStepError
from inferflux.backends.engine import InputTooLongError, InvalidRequestError
from inferflux.backends.openai.request import estimate_tokens
from inferflux.backends.openai.request import RemoteEmbeddingRequest

from inferflux.gateway.errors import ContextLengthExceeded, GatewayError, InternalError, InvalidRequest, UnsupportedParameter
from inferflux.gateway.models.served import ServedModel
from inferflux.gateway.pipeline.generation import engine_error_to_gateway
from inferflux.gateway.settings import EmbeddingSettings, Settings
from inferflux.gateway.validation_errors import first_error

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
MAX_TOTAL_TOKENS = 300_000  # and on their tokens, summed

Input = str | list[str] | list[int] | list[list[int]]


class _InputError(ValueError):
    """Raised inside the ``input`` validator: an OpenAI-shaped 400 naming ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class EmbeddingsRequest(BaseModel):
    """The body of ``POST /v1/embeddings``. Unknown fields are ignored, as OpenAI does."""

    # strict: "dimensions": "8" or true is refused, not coerced.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    input: Input = Field(description=f"A string, a list of strings, a list of token ids or a list of token-id "
                         f"lists; at most {MAX_INPUTS} inputs, none empty")  # fmt: skip
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description="Only for a model configured as matryoshka "
                                   "(or its own size): the vectors' first components, renormalised")  # fmt: skip
    user: str | None = Field(default=None, max_length=256)

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        # Checked by hand: a union error from pydantic lists every alternative, and names no input.
        if isinstance(value, str):
            if not value:
                raise _InputError("input", "input must not be an empty string")
            return value
        if not isinstance(value, list) or not value:
            raise _InputError("input", "input must be a string, a list of token ids, or a non-empty list of those")
        if all(_token(v) for v in value):  # one input of token ids
            return value
        if len(value) > MAX_INPUTS:
            raise _InputError("input", f"at most {MAX_INPUTS} inputs are allowed per request, got {len(value)}")
        if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
            for i, item in enumerate(value):
                if isinstance(item, list) and not all(_token(t) for t in item):
                    raise _InputError(f"input[{i}]", f"input[{i}] must be a list of token ids (integers)")
                if not item:
                    raise _InputError(f"input[{i}]", f"input[{i}] must not be empty")
            return value
        raise _InputError("input", "input must be a string, a list of strings, a list of token ids, "
                          "or a list of token-id lists (not a mixture)")  # fmt: skip

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a string or a token-id list."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]

    @property
    def param_names(self) -> dict[str, str]:
        """The engine's names of the inputs as the client spelled its request: ``input`` for a single one."""
        return {"input[0]": "input"} if len(self.inputs()) == 1 else {}


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_embeddings(body: dict[str, Any]) -> EmbeddingsRequest:
    """The request, or the OpenAI-shaped 400 of its first error (``param`` naming the field or the input)."""
    try:
        return EmbeddingsRequest.model_validate(body)
    except ValidationError as exc:
        first = first_error(exc)
        if isinstance(first.cause, _InputError):
            raise InvalidRequest(first.cause.message, param=first.cause.param) from None
        raise InvalidRequest(first.line(), param=first.path) from None


@dataclass(frozen=True)
class EmbeddingPlan:
    """What a parsed embeddings request asks of a model: its checked request and how to answer."""

    served: ServedModel
    request: EmbeddingRequest | RemoteEmbeddingRequest  # the engine's, or the upstream's
    encoding_format: str
    param_names: dict[str, str]
    user: str | None = None  # the end user the caller named: for the audit event and OPA

    @property
    def prompt_tokens(self) -> int:
        """What the limits reserve: the inputs' tokens (a remote model's: estimated)."""
        request = self.request
        return request.num_tokens if isinstance(request, EmbeddingRequest) else request.prompt_tokens


def plan_embeddings(served: ServedModel, req: EmbeddingsRequest, settings: EmbeddingSettings, tenant: str | None,
                    upstream_headers: tuple[tuple[str, str], ...] = ()) -> EmbeddingPlan:  # fmt: skip
    """The checked request for ``served`` (tokenised here for a local model; sent as it is to an upstream)."""
    request_id = f"emb-{secrets.token_hex(12)}"
    names = req.param_names
    if served.remote:
        inputs = req.inputs()
        estimate = sum(estimate_tokens(i) if isinstance(i, str) else len(i) for i in inputs)
        body: dict[str, Any] = {"model": served.engine.upstream_model, "input": req.input, "encoding_format": "float"}
        if req.dimensions is not None:
            body["dimensions"] = req.dimensions
        if req.user is not None:
            body["user"] = req.user
        remote = RemoteEmbeddingRequest(request_id, body, num_inputs=len(inputs), prompt_tokens=estimate,
                                        headers=dict(upstream_headers), tenant=tenant)  # fmt: skip
        return EmbeddingPlan(served, remote, req.encoding_format, names, req.user)
    if not settings.token_ids and any(not isinstance(i, str) for i in req.inputs()):
        raise _token_ids_refused(served)
    dimensions = _dimensions(served, req.dimensions, settings)
    tokenizer = served.local_tokenizer
    token_lists = [tokenizer.encode(i) if isinstance(i, str) else i for i in req.inputs()]
    total = sum(len(t) for t in token_lists)
    if total > MAX_TOTAL_TOKENS:
        raise InvalidRequest(f"the inputs have {total} tokens in all; at most {MAX_TOTAL_TOKENS} are allowed per "
                             "request", param="input")  # fmt: skip
    try:
        request = served.engine.make_embedding_request(request_id, token_lists, settings.pooling,
                                                       normalize=settings.normalize, dimensions=dimensions,
                                                       tenant=tenant)  # fmt: skip
    except InvalidRequestError as exc:
        raise embedding_error(exc, served, names) from None
    return EmbeddingPlan(served, request, req.encoding_format, names, req.user)


def embedding_settings(served: ServedModel, settings: Settings) -> EmbeddingSettings:
    """How ``served`` embeds: the section it was loaded with through the admin API, else its entry's in the
    configuration, else the defaults."""
    if served.embedding is not None:
        return EmbeddingSettings.model_validate(dict(served.embedding))
    return settings.model_embedding(served.name)


def _token_ids_refused(served: ServedModel) -> InvalidRequest:
    return InvalidRequest(
        f"The model {served.name!r} does not take token ids as input: they would be read as its own vocabulary's "
        "ids, and a client's are usually another tokenizer's (LangChain's OpenAIEmbeddings sends OpenAI's by "
        "default), which embeds other text without an error. Send the text instead (LangChain: "
        "OpenAIEmbeddings(..., check_embedding_ctx_length=False)), or, if the ids are this model's own, have an "
        "operator enable embedding.token_ids for the model",
        param="input",
        code="token_ids_not_enabled",
    )


def _dimensions(served: ServedModel, wanted: int | None, settings: EmbeddingSettings) -> int | None:
    """The length to cut vectors to (None: the model's own), or a 400 naming ``dimensions``."""
    size = served.info.hidden_size
    if wanted is None or wanted == size:
        return None
    if not settings.matryoshka:
        raise UnsupportedParameter(
            f"the model {served.name!r} gives {size}-dimensional embeddings and is not configured to shorten "
            "them (embedding.matryoshka): dimensions may only be its own size",
            param="dimensions",
        )
    if wanted > size:
        raise InvalidRequest(f"dimensions must be from 1 to {size} for the model {served.name!r}", param="dimensions")
    return wanted


def embedding_error(exc: BaseException, served: ServedModel, names: dict[str, str]) -> GatewayError:
    """The client's error for what the engine (or the upstream) raised about an embeddings request."""
    if isinstance(exc, EmbeddingsUnsupportedError):
        # 400, not 404: the model exists and the caller may use it; it does not do this.
        return InvalidRequest(f"The model {served.name!r} does not serve embeddings: {exc}", param="model",
                              code="model_not_supported")  # fmt: skip
    if isinstance(exc, InputTooLongError):
        return ContextLengthExceeded(str(exc).replace(exc.param or "", names.get(exc.param or "", exc.param or "")),
                                     param=names.get(exc.param or "", exc.param))  # fmt: skip
    if isinstance(exc, EngineStepError):
        return InternalError("The engine failed while embedding")
    return engine_error_to_gateway(exc, param_names=names)


async def embed(plan: EmbeddingPlan) -> EmbeddingResult:
    """Run the plan on its model's engine (or upstream); engine and upstream failures as client errors."""
    try:
        return await plan.served.engine.embed(plan.request)  # type: ignore[no-any-return]
    except (InvalidRequestError, EngineStepError) as exc:
        raise embedding_error(exc, plan.served, plan.param_names) from None
    except GatewayError:
        raise
    except Exception as exc:
        raise engine_error_to_gateway(exc) from None


def render_embeddings(plan: EmbeddingPlan, result: EmbeddingResult) -> dict[str, Any]:
    """OpenAI's answer: a list of embeddings in input order, and the inputs' tokens as usage."""
    encode = _base64 if plan.encoding_format == "base64" else _floats
    data = [{"object": "embedding", "index": i, "embedding": encode(vector)} for i, vector in enumerate(result.vectors)]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": plan.served.name, "usage": usage}


def _floats(vector: Any) -> list[float]:
    return vector.tolist()  # type: ignore[no-any-return]


def _base64(vector: Any) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")

