"""A GGUF's tokenizer rebuilt as a ``tokenizers`` pipeline (``Tokenizer.from_gguf_metadata``).

A GGUF carries no ``tokenizer.json``: only a vocabulary, token types, merges (or
scores) and the name of llama.cpp's pre-tokenizer. ``gguf_pipeline`` builds the
equivalent pipeline, byte-level BPE for ``gpt2`` and SentencePiece-style BPE for
``llama`` (``tokenizer.py``'s docstring says how each is made, and why), with the
control, unknown and user-defined tokens added; the post-processor that adds
BOS/EOS is ``tokenizer.py``'s, shared with ``tokenizer.json`` directories.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from inferflux.backends.models.errors import ModelLoadError

# Token types of a GGUF vocabulary (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes, as llama.cpp (llama-vocab.cpp) and the models' tokenizer.json use them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _BPEPreType:
    """How one llama.cpp pre-tokenizer type splits text before byte-level BPE."""

    split_regex: str | None  # None: GPT-2's regex, built into ByteLevel(use_regex=True)
    split_digits: bool = False  # every \p{N} its own piece first (StarCoder / SmolLM)
    ignore_merges: bool = False  # a piece that is a whole vocab token is taken as is (Llama 3)
    add_bos_default: bool = False  # llama.cpp's default when the file has no add_bos_token


_GPT2 = _BPEPreType(None)
_SMOLLM = _BPEPreType(None, split_digits=True)
_LLAMA3 = _BPEPreType(_LLAMA3_SPLIT, ignore_merges=True, add_bos_default=True)
_QWEN2 = _BPEPreType(_QWEN2_SPLIT)

BPE_PRE_TYPES: dict[str, _BPEPreType] = {
    "default": _GPT2, "gpt-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "smollm": _SMOLLM, "starcoder": _SMOLLM, "refact": _SMOLLM, "command-r": _SMOLLM,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def gguf_pipeline(meta: Mapping[str, Any], source: str) -> tuple[_Backend, list[str], bool]:
    """The ``tokenizers`` pipeline of a GGUF's ``tokenizer.*`` metadata (``meta`` maps key -> python
    value), without its post-processor; its vocabulary; and whether its kind adds BOS by default."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{source}: the GGUF has no tokenizer vocabulary", {"path": source})
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError(f"{source}: tokenizer.ggml.token_type and tokens differ in length", {"path": source})
    try:
        if kind == "gpt2":
            backend, add_bos_default = _byte_level_bpe(meta, tokens, types, source)
        elif kind == "llama":
            backend, add_bos_default = _sentencepiece_bpe(meta, tokens, types, source), True
        else:
            raise ModelLoadError(
                f"{source}: unsupported tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece BPE)",
                {"path": source, "tokenizer": kind},
            )
    except ModelLoadError:
        raise
    except Exception as e:  # the tokenizers library rejects inconsistent vocab / merges
        raise ModelLoadError(f"{source}: cannot build the tokenizer: {e}", {"path": source}) from e
    return backend, tokens, add_bos_default


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                    source: str) -> tuple[_Backend, bool]:
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    pre = BPE_PRE_TYPES.get(pre_name)
    if pre is None:
        raise ModelLoadError(
            f"{source}: unsupported tokenizer pre-type {pre_name!r}; supported: {', '.join(sorted(BPE_PRE_TYPES))}",
            {"path": source, "pre": pre_name},
        )
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(token: str) -> str:
        # A few files store user-defined tokens as raw text; BPE needs the byte-level spelling.
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spell(t): i for i, t in enumerate(tokens)}
    merges_raw = meta.get("tokenizer.ggml.merges")
    if merges_raw is None:
        raise ModelLoadError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges", {"path": source})
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise ModelLoadError(f"{source}: malformed BPE merge {m!r}", {"path": source})
        merges.append((left, right))
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre.split_digits:
        steps.append(pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"))
    if pre.split_regex is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split_regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.split_regex is None))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    # Only tokens spelled in the byte alphabet can be added as themselves; a control token that
    # is not is a mislabelled vocab entry, and adding it would grow the vocabulary (as HF skips it).
    _add_tokens(backend, tokens, types, usable=lambda t: set(t) <= alphabet)
    return backend, pre.add_bos_default


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int], source: str) -> _Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges_raw = meta.get("tokenizer.ggml.merges")
    if merges_raw is not None:
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(f"{source}: SentencePiece vocabulary without scores or merges", {"path": source})
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_tokens(backend, tokens, types, usable=lambda t: True)
    return backend


def _merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges: every split of a token into two vocab tokens, the merge whose
    result scores highest first (ties: longer left piece, then longer right piece)."""
    ranked = []
    for token, score in scores.items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((score, len(left), len(right), left, right) for left, right in pairs)
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)  # stable: ties keep vocab order
    return [(left, right) for _, _, _, left, right in ranked]


def _add_tokens(backend: _Backend, tokens: list[str], types: list[int], usable: Any) -> None:
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types)
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN) and usable(t)
    ]
    plain = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types)
        if kind == TOKEN_USER_DEFINED and usable(t)
    ]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)
