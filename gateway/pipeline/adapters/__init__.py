"""Vendor APIs over the chat-completions path: OpenAI's Responses API and Anthropic's Messages API.

Each adapter translates its vendor's body into a chat-completions body, which
takes the chat path's own steps (``gateway.pipeline.run``), and the chat
answer back into the vendor's shape (``responses_request`` holds the Responses
API's body and its input as chat messages); ``common`` holds what both share and
``errors`` Anthropic's error bodies; ``anthropic_count`` the body of Anthropic's token count, a Messages body
whose prompt is counted, not answered.
"""

from inferflux.gateway.pipeline.adapters.anthropic import MessagesAdapter, MessagesRequest, parse_messages
from inferflux.gateway.pipeline.adapters.anthropic_count import CountTokensRequest, parse_count_tokens
from inferflux.gateway.pipeline.adapters.common import Adapter, AdapterRenderer
from inferflux.gateway.pipeline.adapters.errors import AnthropicErrors
from inferflux.gateway.pipeline.adapters.responses import ResponsesAdapter, parse_responses
from inferflux.gateway.pipeline.adapters.responses_request import ResponsesRequest

__all__ = [
    "Adapter",
    "AdapterRenderer",
    "AnthropicErrors",
    "CountTokensRequest",
    "MessagesAdapter",
    "MessagesRequest",
    "ResponsesAdapter",
    "ResponsesRequest",
    "parse_count_tokens",
    "parse_messages",
    "parse_responses",
]
