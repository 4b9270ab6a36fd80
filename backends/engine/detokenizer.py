"""Incremental detokenisation and stop conditions, one instance per sequence.

Text is produced with the prefix/read-offset technique: the new tokens are
decoded together with a few tokens before them (the "prefix window") and only
the text beyond the window's own decode is new. A token that ends in the middle
of a UTF-8 character (byte-fallback or byte-level BPE pieces of an emoji or a
CJK character) decodes to U+FFFD; such text is held until the character is
complete, so a streamed delta never contains a half character.

Stop strings: the text is cut before the first stop string found. While
streaming, any suffix that could still grow into a stop string is held back,
so a client never sees part of a stop string that later matches.

Stop tokens (``stop_token_ids``, and the tokenizer's ``eos_token_ids`` unless
``ignore_eos``) end the sequence with reason "stop" and contribute no text. None
of the stop conditions apply before ``min_tokens`` tokens were generated.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from .sampling_params import SamplingParams

# Prompt tokens used as the first prefix window: enough for tokenizers whose
# decode depends on the preceding token (SentencePiece's leading space).
PROMPT_CONTEXT_TOKENS = 5
# The id list is trimmed once the prefix window has moved this far in.
_TRIM_AT = 64
REPLACEMENT_CHAR = "\ufffd"


class DecodingTokenizer(Protocol):
    """The part of backends.models.Tokenizer the engine uses."""

    eos_token_ids: frozenset[int]

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids: Seq[int]) -> list[str]: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: DecodingTokenizer,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings = list(params.stop)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids |= frozenset(eos_token_ids)
        self.min_tokens = params.min_tokens

        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset]

        self.text = ""  # output text so far; cut before the stop string once one matched
        self._emitted = 0  # chars of self.text already handed out by take_delta
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string that ended the text, once one did

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> str | None:
        """Feed one generated token. Returns "stop" when it ends the sequence."""
        if self.finish_reason is not None:
            return self.finish_reason
        self.num_output_tokens += 1
        if token_id in self.stop_token_ids and self.num_output_tokens > self.min_tokens:
            self._decode(final=True)  # release bytes held for a character that will never complete
            return self._finish("stop")
        self._ids.append(token_id)
        old_len = len(self.text)
        self._decode(final=False)
        if self._stop_string_found(old_len):
            return self._finish("stop")
        return None

    def finish(self, reason: str) -> str:
        """End the sequence for an outside reason ("length"); flushes held text.
        Returns the final reason (a stop string in the flushed text wins)."""
        if self.finish_reason is not None:
            return self.finish_reason
        old_len = len(self.text)
        self._decode(final=True)
        if self._stop_string_found(old_len):
            reason = "stop"
        return self._finish(reason)

    def take_delta(self) -> str:
        """Text that is safe to show now and was not returned before."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= self._held_back()
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    # -- internals

    def _finish(self, reason: str) -> str:
        self.finish_reason = reason
        return reason

    def _decode(self, *, final: bool) -> None:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        if self._prefix_text is None:
            self._prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(new_text) <= len(self._prefix_text):
            return  # the new tokens add no text (yet): a skipped special token
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return  # a character is split across tokens: wait for the rest of it
        self.text += new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _stop_string_found(self, old_len: int) -> bool:
        """Cut the text before the earliest stop string that ends in text added
        after ``old_len``; True when one was found."""
        if not self.stop_strings or len(self.text) == old_len or self.num_output_tokens < self.min_tokens:
            return False
        cut = -1
        for stop in self.stop_strings:
            i = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if i != -1 and (cut == -1 or i < cut):
                cut, self.stop_string = i, stop
        if cut == -1:
            return False
        self.text = self.text[:cut]
        return True

    def _held_back(self) -> int:
        """Length of the longest unemitted suffix that is a proper prefix of a stop string."""
        pending = len(self.text) - self._emitted
        held = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, pending), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return held
