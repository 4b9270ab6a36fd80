"""Per-request sampling parameters, validated with OpenAI's ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import SamplingParamsError
from .guided import GuidedSpec

MAX_SPECULATIVE_K = 16
MAX_STOP_STRINGS = 64  # the gateway's configurable bound (16 by default) stays below it
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax (as vLLM)
MAX_LOGIT_BIAS = 300  # OpenAI's limits: at most 300 entries, each in [-100, 100]
LOGIT_BIAS_RANGE = 100.0


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy (argmax). ``top_k`` 0 or -1 and ``top_p`` 1
    and ``min_p`` 0 disable those filters. ``max_tokens=None`` means "until the
    context (or the KV cache) is full". Penalties follow vLLM: the repetition
    penalty applies to tokens of the prompt and the output, presence and
    frequency penalties to tokens of the output only.

    ``logit_bias`` (OpenAI's): token id -> a number in [-100, 100] added to
    that token's logit before sampling; -100 all but bans a token, 100 all but
    forces it. ``guided``: a grammar the output must match (structured
    outputs, ``backends.engine.guided``); ``make_request`` compiles it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt's own logprobs (backends.engine.prompt_logprobs): None off, n: each prompt
    # token's and its n best alternatives', in the first output (the completions API's echo).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Speculative decoding, where the model has it on: None follows the model's
    # setting, 0 turns it off for this request, n caps the draft at n tokens.
    speculative_k: int | None = None
    logit_bias: dict[int, float] | None = None
    guided: GuidedSpec | None = None

    def __post_init__(self) -> None:
        # OpenAI accepts a bare string for "stop"; normalise so the rest of the
        # engine only ever sees a list.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        # Tiny temperatures are greedy too: 1/T would overflow float32 logits.
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise ``SamplingParamsError`` naming the first offending field."""
        _number("temperature", self.temperature, 0.0, 2.0)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _integer("top_k", self.top_k, -1, None)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        if self.seed is not None:
            _integer("seed", self.seed, -(2**63), 2**64 - 1)

        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                "stop", f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(self.stop)}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"stop sequences must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, 0, vocab_size - 1)

        _boolean("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1, None)
        _integer("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        _boolean("logprobs", self.logprobs)
        _integer("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise SamplingParamsError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        _boolean("skip_special_tokens", self.skip_special_tokens)
        if self.speculative_k is not None:
            _integer("speculative_k", self.speculative_k, 0, MAX_SPECULATIVE_K)
        if self.logit_bias is not None:
            _logit_bias(self.logit_bias, vocab_size)
        if self.guided is not None:
            if not isinstance(self.guided, GuidedSpec):
                raise SamplingParamsError("guided", f"guided must be a GuidedSpec, got {type(self.guided).__name__}")
            self.guided.validate()


def _number(name: str, value: object, low: float, high: float | None, *, low_open: bool = False) -> None:
    # bool is an int subclass; True as a temperature is a client bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"{name} must be finite, got {value!r}")
    too_low = value <= low if low_open else value < low
    if high is None:
        if too_low:
            relation = ">" if low_open else ">="
            raise SamplingParamsError(name, f"{name} must be {relation} {low:g}, got {value!r}")
    elif too_low or value > high:
        left = "(" if low_open else "["
        raise SamplingParamsError(name, f"{name} must be in {left}{low:g}, {high:g}], got {value!r}")


def _integer(name: str, value: object, low: int | None, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise SamplingParamsError(name, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise SamplingParamsError(name, f"{name} must be <= {high}, got {value}")


def _logit_bias(bias: object, vocab_size: int) -> None:
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", f"logit_bias must map token ids to numbers, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise SamplingParamsError(
            "logit_bias", f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}"
        )
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise SamplingParamsError(
                "logit_bias", f"logit_bias token {token!r} is not a token id of this model (0..{vocab_size - 1})"
            )
        try:
            _number(f"logit_bias[{token}]", value, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
        except SamplingParamsError as exc:
            raise SamplingParamsError("logit_bias", exc.message) from None


def _boolean(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be a boolean, got {value!r}")
