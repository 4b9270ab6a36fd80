"""``POST /v1/messages/count_tokens``: Anthropic's token count of a Messages body's prompt.

The body is a Messages body (``anthropic``'s ``MessagesRequest``: ``model``,
``messages``, ``system``, ``tools``, ``tool_choice``; the same refusals) without
``max_tokens``, which a count does not take (given, it is checked and
ignored). It becomes the same chat body, whose prompt the driver
(``gateway.pipeline.run.count_tokens``) renders through the model's chat
template and tokenizer as ``/v1/messages`` renders it (``plan.count_chat``), so
the answer, ``{"input_tokens": N}``, is what that call's ``usage.input_tokens``
would be.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from inferflux.gateway.pipeline.adapters.anthropic import MessagesAdapter, MessagesRequest, parse_messages


class CountTokensRequest(MessagesRequest):
    """Anthropic's count_tokens body: a Messages body whose ``max_tokens`` is not asked for."""

    max_tokens: int | None = Field(default=None, ge=1, description="not part of a count: checked and ignored")


def parse_count_tokens(body: dict[str, Any]) -> MessagesAdapter:
    """The count's body parsed as a Messages body is (the same 400s, naming Anthropic's fields)."""
    adapter = parse_messages(body, CountTokensRequest)
    adapter.req.max_tokens = None  # nothing is generated: the chat body asks for no completion
    return adapter
