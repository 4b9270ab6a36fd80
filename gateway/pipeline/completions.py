"""What only the legacy completions route does: ``suffix`` (fill-in-the-middle), ``best_of``, ``echo`` + ``logprobs``.

- ``suffix``: the model completes the text between the prompt and the suffix.
  That needs a model trained for it, whose tokenizer has fill-in-the-middle
  tokens; the prompt becomes ``<prefix-token> prompt <suffix-token> suffix
  <middle-token>`` (the PSM order the code models below were trained on), the
  prompt and the suffix tokenised apart (a prompt of token ids is used as
  given). A model without such tokens (SmolLM2 has none) refuses ``suffix``:
  ignoring it would answer a different question.
- ``best_of``: ``best_of`` candidates per prompt are generated (each counted in
  the usage and reserved by the limits) and the ``n`` with the highest mean
  logprob per token are returned, best first, as OpenAI did. Not with
  ``stream``: the best are only known once all have finished.
- ``echo`` with ``logprobs``: the engine scores the prompt
  (``SamplingParams.prompt_logprobs``) and the answer's logprobs begin with the
  prompt's tokens, the first with a null logprob, as OpenAI's do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from inferflux.gateway.errors import UnsupportedParameter

if TYPE_CHECKING:
    from inferflux.backends.engine import RequestOutput

    from inferflux.gateway.pipeline.generation import ChoiceSpec

# The fill-in-the-middle tokens of the model families that have them: (prefix, suffix, middle).
FIM_TOKENS: tuple[tuple[str, str, str], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


class FimTokenizer(Protocol):
    bos_token_id: int | None
    add_bos_token: bool

    def token_to_id(self, token: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def fim_ids(tokenizer: FimTokenizer) -> tuple[int, int, int] | None:
    """The tokenizer's (prefix, suffix, middle) token ids, None if it has no complete set."""
    for names in FIM_TOKENS:
        ids = [tokenizer.token_to_id(name) for name in names]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]  # type: ignore[return-value]
    return None


def fim_prompt(tokenizer: FimTokenizer, model: str, prompt: str | Sequence[int], suffix: str) -> list[int]:
    """The fill-in-the-middle prompt for ``prompt`` (text, or token ids as given) and ``suffix``;
    400 ``unsupported_parameter`` naming ``suffix`` for a model without the tokens."""
    ids = fim_ids(tokenizer)
    if ids is None:
        raise UnsupportedParameter(
            f"suffix needs a model trained for fill-in-the-middle, and the model {model!r} has no "
            "fill-in-the-middle tokens (<fim_prefix>/<fim_suffix>/<fim_middle> or the like)",
            param="suffix",
        )
    pre, suf, mid = ids
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []
    head = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
    return [*bos, pre, *head, suf, *tokenizer.encode(suffix, add_special_tokens=False), mid]


def mean_logprob(outputs: Sequence[RequestOutput]) -> float:
    """A candidate's mean logprob per generated token (-inf without tokens: never the best)."""
    values = [lp.logprob for out in outputs for lp in (out.logprobs or [])]
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite and len(finite) == len(values) else -math.inf


def keep_best(choices: Sequence[ChoiceSpec], outputs: dict[int, list[RequestOutput]],
              n: int) -> list[tuple[int, int, list[Any]]]:  # fmt: skip
    """Of each prompt's candidates (a plan's ``choices``), the ``n`` with the highest mean logprob, best first
    (ties: the earlier).

    Returns ``(answer index, candidate index, outputs)``: answers are numbered
    ``prompt_index * n + rank``, as choices are without ``best_of``.
    """
    by_prompt: dict[int, list[int]] = {}
    for choice in choices:
        by_prompt.setdefault(choice.prompt_index, []).append(choice.index)
    kept = []
    for p_index, candidates in sorted(by_prompt.items()):
        ranked = sorted(candidates, key=lambda i: (-mean_logprob(outputs.get(i, [])), i))
        kept += [(p_index * n + rank, i, outputs.get(i, [])) for rank, i in enumerate(ranked[:n])]
    return kept
