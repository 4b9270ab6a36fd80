"""Token-id prompts and inputs as text, for the input guardrails (``RequestPolicy.screen``).

A completion's ``prompt`` or an embeddings ``input`` may be token ids rather
than text. The model reads them all the same, so a tenant's input guardrails
read them too: decoded with the tokenizer of the model the body names, special
tokens written out. Where that cannot be done (the model is unknown to the
caller, or served by an upstream, with no tokenizer here), ``token_decoder``
gives None and such a tenant's token ids are refused (400
``token_ids_unchecked``) rather than let through unread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from inferflux.gateway.errors import ModelNotFound
from inferflux.policy.guardrails.texts import Decode

if TYPE_CHECKING:
    from inferflux.gateway.pipeline.call import Call


def token_decoder(call: Call, body: Mapping[str, Any]) -> Decode | None:
    """How to read token ids for the model ``body`` names; None if they cannot be read here."""
    name = body.get("model")
    if not isinstance(name, str):
        return None
    try:
        served = call.state.manager.get(name)
    except ModelNotFound:
        return None
    if served.remote or served.tokenizer is None or not call.principal.may_use_model(served.name):
        return None  # the same answer for a model the caller may not use as for a missing one
    tokenizer = served.tokenizer
    size = tokenizer.vocab_size

    def decode(ids: Sequence[int]) -> str:
        # Ids past the tokenizer's vocabulary (rows of the model's embedding that no text encodes to) hold
        # no text; the engine refuses ids past the model's own.
        return tokenizer.decode([i for i in ids if 0 <= i < size], skip_special_tokens=False)

    return decode
