"""Errors the engine raises.

Two families, so callers can map them without inspecting messages:

* ``InvalidRequestError`` (a ``ValueError``): the request itself is wrong and
  retrying it unchanged will fail again. The gateway maps these to HTTP 400.
* ``EngineError``: the engine could not serve a valid request (a backend step
  failed, the engine is shut down, an internal invariant broke). HTTP 500/503.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses to run as given."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the offending request field, when there is one

    def __str__(self) -> str:
        return self.message


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or of the wrong type."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param=param)


class GrammarTooComplexError(SamplingParamsError):
    """A grammar over its budget: its compile, its first mask or a later mask needed more CPU time or
    memory than it may have (``grammar_sandbox``, ``guided``). The gateway's 400 ``schema_too_complex``."""

    def __init__(self, message: str, param: str = "guided") -> None:
        super().__init__(param, message)


class InvalidPromptError(InvalidRequestError):
    """The prompt token ids are unusable (empty, out of vocabulary range, ...)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="prompt")


class EmptyPromptError(InvalidPromptError):
    def __init__(self) -> None:
        super().__init__("the prompt is empty; at least one token is required")


class PromptTooLongError(InvalidRequestError):
    """prompt + max_tokens does not fit the model's context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        if max_tokens is None:
            message = (
                f"the prompt has {prompt_tokens} tokens, which leaves no room to generate "
                f"within the maximum context length of {max_model_len} tokens"
            )
        else:
            message = (
                f"this model's maximum context length is {max_model_len} tokens, but "
                f"{prompt_tokens + max_tokens} were requested ({prompt_tokens} in the prompt "
                f"+ {max_tokens} max_tokens); shorten the prompt or lower max_tokens"
            )
        super().__init__(message, param="max_tokens" if max_tokens is not None else "prompt")


class CacheCapacityError(InvalidRequestError):
    """The request could never fit the KV cache, even with every other request evicted."""

    def __init__(self, tokens_needed: int, blocks_needed: int, num_blocks: int, block_size: int) -> None:
        self.tokens_needed = tokens_needed
        self.blocks_needed = blocks_needed
        self.num_blocks = num_blocks
        self.block_size = block_size
        super().__init__(
            f"the request needs KV space for {tokens_needed} tokens ({blocks_needed} blocks of "
            f"{block_size}), but the whole KV cache holds {num_blocks} blocks "
            f"({num_blocks * block_size} tokens); shorten the prompt or lower max_tokens",
            param="max_tokens",
        )


class InputTooLongError(InvalidRequestError):
    """An embedding input is longer than the model's context."""

    def __init__(self, param: str, tokens: int, max_model_len: int) -> None:
        self.tokens = tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"this model's maximum context length is {max_model_len} tokens, but {param} has {tokens}; shorten it",
            param=param,
        )


class EmbeddingsUnsupportedError(InvalidRequestError):
    """The model's backend cannot compute embeddings (it has no ``embed``)."""

    def __init__(self, backend: str) -> None:
        super().__init__(f"the {backend} backend serving this model does not compute embeddings", param="model")


class DuplicateRequestError(InvalidRequestError):
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request id {request_id!r} is already in flight", param="request_id")


class EngineError(Exception):
    """The engine failed to serve a request that was valid."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class EngineConfigError(EngineError, ValueError):
    """An EngineConfig value is unusable (raised when the engine is built)."""


class BlockManagerError(EngineError, RuntimeError):
    """An internal KV-block bookkeeping invariant broke (double free, unknown block).

    Always an engine bug, never the client's fault.
    """


class EngineStepError(EngineError):
    """A step of the engine loop raised; every request in flight at that moment fails.

    The original exception is chained as ``__cause__``.
    """


class GrammarBusyError(EngineError):
    """Every grammar worker stayed busy for the whole wait (``GrammarBudget.queue_seconds``): a 503, retryable."""


class GrammarCancelledError(EngineError):
    """A grammar check stopped because its caller cancelled it (the client left); nobody reads the answer."""


class EngineDeadError(EngineError):
    """The engine loop is shut down or broken beyond recovery; no request can run."""
