"""Tokenizers for GGUF files and Hugging Face directories, on the ``tokenizers`` library.

A GGUF carries no ``tokenizer.json``: only a vocabulary, token types, merges (or scores) and
the name of llama.cpp's pre-tokenizer. We rebuild the equivalent ``tokenizers`` pipeline
(``gguf_tokenizer.py``):

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. The pre-tokenizer regex comes from
  ``tokenizer.ggml.pre`` (the same regexes llama.cpp applies); an unknown pre type is an
  error rather than a silent fallback, because a wrong split changes every id.
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE with byte fallback and the
  ``U+2581`` space marker, merges derived from the scores when the file has none -- the
  same construction transformers uses, so ids agree with ``AutoTokenizer``.

Control and unknown tokens become special added tokens (never split, dropped by
``decode(skip_special_tokens=True)``); user-defined ones become plain added tokens (never
split, always decoded). BOS/EOS are added by a post-processor, so ``encode`` behaves the
same whether the pipeline came from a GGUF or from a ``tokenizer.json``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import Tokenizer as _Backend
from tokenizers import processors

from inferflux.backends.models.chat_template import CHATML_TEMPLATE, ChatTemplate
from inferflux.backends.models.errors import ModelLoadError
from inferflux.backends.models.gguf_tokenizer import gguf_pipeline

# Tokens that end an assistant turn in common chat formats; generation stops on any of them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>")

class Tokenizer:
    """Text <-> token ids, special tokens, and the model's chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        eos = {i for i in (eos_token_id, *extra_eos_token_ids) if i is not None}
        eos.update(i for i in (backend.token_to_id(t) for t in END_OF_TURN_TOKENS) if i is not None)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.has_chat_template = chat_template is not None
        self.chat_template: str = chat_template if chat_template is not None else CHATML_TEMPLATE
        self.bos_token = self._token(bos_token_id)
        self.eos_token = self._token(eos_token_id)
        self.unk_token = self._token(unk_token_id)
        self.pad_token = self._token(pad_token_id)
        # Read back from the pipeline, not from metadata, so it is true for tokenizer.json too.
        self.add_bos_token, self.add_eos_token = _special_flags(backend, bos_token_id, eos_token_id)
        self._template: ChatTemplate | None = None

    # ----- the contract -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (may be less than the model's embedding rows)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token strings inside ``text`` (``<|im_start|>``)
        become their special ids; ``add_special_tokens`` adds BOS/EOS as the model expects."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary spelling of each id (byte-level ``Ġ``/``▁`` forms), None if unknown."""
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the model's template (ChatML if it has none)."""
        if self._template is None:
            self._template = ChatTemplate(
                self.chat_template,
                {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token},
            )
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    # ----- persistence --------------------------------------------------------------

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer`` (shared: do not reconfigure it)."""
        return self._backend

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (loadable by transformers)."""
        os.makedirs(directory, exist_ok=True)
        self._backend.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "unk_token": self.unk_token, "pad_token": self.pad_token,
            "add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token,
        }
        if self.has_chat_template:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    # ----- construction -------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str) -> "Tokenizer":
        """Build from a GGUF's ``tokenizer.*`` metadata (``meta`` maps key -> python value)."""
        backend, tokens, add_bos_default = gguf_pipeline(meta, source)

        def special_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}_token_id")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos, eos = special_id("bos"), special_id("eos")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        _set_post_processor(backend, bos if add_bos else None, eos if add_eos else None, tokens)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_token_ids=[i for i in [special_id("eot"), special_id("eom")] if i is not None],
            chat_template=meta.get("tokenizer.chat_template"),
            unk_token_id=special_id("unknown"),
            pad_token_id=special_id("padding"),
        )

    @classmethod
    def from_hf_dir(cls, directory: str, model_config: Mapping[str, Any] | None = None) -> "Tokenizer":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``)."""
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"{directory}: no tokenizer.json (only fast tokenizers are supported)",
                                 {"path": directory})
        try:
            backend = _Backend.from_file(path)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tokenizer: {e}", {"path": path}) from e
        tcfg = _read_json(os.path.join(directory, "tokenizer_config.json"), default={})
        gen = _read_json(os.path.join(directory, "generation_config.json"), default={})
        model_config = model_config or {}

        def special_id(name: str) -> int | None:
            token = tcfg.get(f"{name}_token")
            if isinstance(token, Mapping):
                token = token.get("content")
            if isinstance(token, str):
                return backend.token_to_id(token)
            ids = _id_list(gen.get(f"{name}_token_id", model_config.get(f"{name}_token_id")))
            return ids[0] if ids else None

        bos, eos = special_id("bos"), special_id("eos")
        # HF's slow-to-fast Llama tokenizers add BOS from this flag, not from tokenizer.json.
        if "add_bos_token" in tcfg or "add_eos_token" in tcfg:
            has_bos, has_eos = _special_flags(backend, bos, eos)
            want_bos = bool(tcfg.get("add_bos_token", has_bos)) and bos is not None
            want_eos = bool(tcfg.get("add_eos_token", has_eos)) and eos is not None
            if (want_bos, want_eos) != (has_bos, has_eos):
                tokens = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
                _set_post_processor(backend, bos if want_bos else None, eos if want_eos else None, tokens)
        extra_eos = _id_list(gen.get("eos_token_id")) + _id_list(model_config.get("eos_token_id"))
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_token_ids=extra_eos,
            chat_template=_hf_chat_template(directory, tcfg),
            unk_token_id=special_id("unk") if tcfg.get("unk_token") else None,
            pad_token_id=special_id("pad") if tcfg.get("pad_token") else None,
        )


def _special_flags(backend: _Backend, bos: int | None, eos: int | None) -> tuple[bool, bool]:
    """Whether ``encode(..., add_special_tokens=True)`` adds BOS / EOS around the text."""
    core = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    start = next((k for k in range(len(full) - len(core) + 1) if full[k : k + len(core)] == core), 0)
    add_bos = bos is not None and start > 0 and full[0] == bos
    add_eos = eos is not None and len(full) > start + len(core) and full[-1] == eos
    return add_bos, add_eos


def _set_post_processor(backend: _Backend, bos: int | None, eos: int | None, tokens: Any) -> None:
    if bos is None and eos is None:
        backend.post_processor = None
        return
    single, pair, specials = "$A:0", "$A:0 $B:1", []
    if bos is not None:
        single, pair = f"{tokens[bos]}:0 {single}", f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1"
        specials.append((tokens[bos], bos))
    if eos is not None:
        single = f"{single} {tokens[eos]}:0"
        pair = pair.replace("$A:0", f"$A:0 {tokens[eos]}:0").replace("$B:1", f"$B:1 {tokens[eos]}:1")
        if eos != bos:
            specials.append((tokens[eos], eos))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# ----- Hugging Face directory helpers ------------------------------------------------


def _read_json(path: str, default: Any) -> Any:
    if not os.path.isfile(path):
        return default
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}", {"path": path}) from e


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _hf_chat_template(directory: str, tcfg: Mapping[str, Any]) -> str | None:
    # Newer transformers save the template beside the config rather than inside it.
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None
