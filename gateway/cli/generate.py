"""Client commands of the OpenAI-compatible API: ``inferctl models``, ``complete``, ``chat`` and ``embed``;
``count-tokens``, through Anthropic's ``/v1/messages/count_tokens``.

A streamed answer is read with ``httpx-sse`` (the server's ``data:`` events,
up to ``data: [DONE]``); an error the server sends in the stream, after its
200, ends the command with that error's message.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from httpx_sse import connect_sse

from inferflux.gateway.cli import interactive
from inferflux.gateway.cli.client import add_client_options, connect, raise_for_error, stream_payloads
from inferflux.gateway.cli.common import EXIT_OK, ClientError

# (a choice of the answer, whether it is the whole answer rather than a stream's chunk) -> its text
TextOf = Callable[[dict[str, Any], bool], str]


def _models(args: argparse.Namespace) -> int:
    with connect(args) as client:
        response = client.get("/v1/models")
        raise_for_error(response)
        data = response.json()["data"]
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    for model in data:
        aliases = ", ".join(model.get("aliases") or [])
        print(f"{model['id']}" + (f"  (aliases: {aliases})" if aliases else ""))
    return EXIT_OK


def _model(client: Any, model: str | None) -> str:
    """``model``, or the first model the server lists."""
    if model is not None:
        return model
    response = client.get("/v1/models")
    raise_for_error(response)
    models = response.json()["data"]
    if not models:
        raise ClientError("the server serves no model")
    return str(models[0]["id"])


def _generate(args: argparse.Namespace, path: str, body: dict[str, Any], text_of: TextOf) -> int:
    with connect(args) as client:
        body = {**body, "model": _model(client, args.model), "max_tokens": args.max_tokens, "stream": not args.no_stream}
        if args.temperature is not None:
            body["temperature"] = args.temperature
        if args.no_stream or args.json:
            body["stream"] = False
            response = client.post(path, json=body)
            raise_for_error(response)
            answer = response.json()
            print(json.dumps(answer, indent=2) if args.json else text_of(answer["choices"][0], True))
            return EXIT_OK
        with connect_sse(client, "POST", path, json=body) as events:
            raise_for_error(events.response)
            for payload in stream_payloads(events):
                for choice in payload.get("choices", []):
                    print(text_of(choice, False), end="", flush=True)
        print()
    return EXIT_OK


def _complete(args: argparse.Namespace) -> int:
    def text_of(choice: dict[str, Any], full: bool) -> str:
        return str(choice.get("text") or "")

    return _generate(args, "/v1/completions", {"prompt": args.prompt}, text_of)


def _chat(args: argparse.Namespace) -> int:
    if args.interactive:
        if args.message is not None or args.json or args.tools is not None:
            raise ClientError("--interactive takes no MESSAGE, --json or --tools: the conversation is typed")
        return interactive.run(args, _model)
    if args.message is None:
        raise ClientError("give a MESSAGE, or --interactive for a conversation")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})
    body: dict[str, Any] = {"messages": messages}
    if args.tools is not None:
        body["tools"] = _read_tools(args.tools)
    if args.tool_choice is not None:
        choice = args.tool_choice
        body["tool_choice"] = choice if choice in ("none", "auto", "required") else {
            "type": "function", "function": {"name": choice}}  # fmt: skip
    calls: dict[int, list[str]] = {}  # index -> [name, arguments so far]

    def text_of(choice: dict[str, Any], full: bool) -> str:
        part = choice.get("message" if full else "delta") or {}
        for n, call in enumerate(part.get("tool_calls") or ()):
            function = call.get("function") or {}
            entry = calls.setdefault(call.get("index", n), ["", ""])
            entry[0] += function.get("name") or ""
            entry[1] += function.get("arguments") or ""
        text = str(part.get("content") or "")
        if choice.get("finish_reason") and calls:  # the calls, a line each, once they are complete
            text += "".join(f"\ntool call: {name}({arguments})" for name, arguments in calls.values())
        return text

    return _generate(args, "/v1/chat/completions", body, text_of)


def _read_tools(path: str) -> list[Any]:
    """The tools of ``--tools``: a JSON file holding OpenAI's list of tool objects."""
    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except (OSError, ValueError) as exc:
        raise ClientError(f"cannot read the tools in {path}: {exc}") from None
    if not isinstance(tools, list):
        raise ClientError(f"{path} must hold a JSON list of tools ({{\"type\": \"function\", \"function\": ...}})")
    return tools


def _embed(args: argparse.Namespace) -> int:
    """One JSON array a line, in input order (``--json``: the whole answer, usage included)."""
    with connect(args) as client:
        body: dict[str, Any] = {"model": _model(client, args.model), "input": args.texts}
        if args.dimensions is not None:
            body["dimensions"] = args.dimensions
        response = client.post("/v1/embeddings", json=body)
        raise_for_error(response)
        answer = response.json()
    if args.json:
        print(json.dumps(answer, indent=2))
        return EXIT_OK
    for item in answer["data"]:
        print(json.dumps(item["embedding"], separators=(",", ":")))
    return EXIT_OK


def _count_tokens(args: argparse.Namespace) -> int:
    """The tokens of a one-message prompt, as the model reads it (its chat template around the text)."""
    with connect(args) as client:
        body: dict[str, Any] = {"model": _model(client, args.model), "messages": [{"role": "user",
                                                                                  "content": args.message}]}
        if args.system is not None:
            body["system"] = args.system
        response = client.post("/v1/messages/count_tokens", json=body)
        raise_for_error(response)
        answer = response.json()
    print(json.dumps(answer, indent=2) if args.json else answer["input_tokens"])
    return EXIT_OK


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model id (default: the first model the server lists)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: %(default)s)")
    parser.add_argument("--temperature", type=float, help="sampling temperature, 0 for greedy (default: the server's)")
    parser.add_argument("--no-stream", action="store_true", help="wait for the whole answer instead of streaming it")
    parser.add_argument("--json", action="store_true", help="print the whole answer as JSON (not streamed)")


def add_models_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``models`` to ``inferctl``'s commands."""
    models = sub.add_parser("models", help="list the models a running server serves")
    add_client_options(models)
    models.add_argument("--json", action="store_true", help="print the raw model objects")
    models.set_defaults(handler=_models)


def add_generation_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``complete``, ``chat``, ``embed`` and ``count-tokens`` to ``inferctl``'s commands."""
    complete = sub.add_parser("complete", help="complete a prompt on a running server")
    complete.add_argument("prompt", help="the text to continue")
    add_client_options(complete)
    _add_generation_options(complete)
    complete.set_defaults(handler=_complete)

    chat = sub.add_parser("chat", help="send one chat message to a running server, or converse (--interactive)")
    chat.add_argument("message", nargs="?", help="the user message (not with --interactive)")
    chat.add_argument("-i", "--interactive", action="store_true", help="a conversation on the terminal: history, "
                      "streaming, /reset, /model NAME, /system TEXT, /exit; Ctrl-C cancels an answer, Ctrl-D leaves")
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--tools", metavar="FILE", help="a JSON file with a list of tools (OpenAI's shape) the model may "
                      "call; the calls are printed as 'tool call: name(arguments)'")
    chat.add_argument("--tool-choice", metavar="CHOICE", help="none, auto, required, or a function's name")
    add_client_options(chat)
    _add_generation_options(chat)
    chat.set_defaults(handler=_chat)

    embed = sub.add_parser("embed", help="embed texts on a running server (one JSON array a line, in input order)")
    embed.add_argument("texts", nargs="+", metavar="TEXT", help="a text to embed")
    add_client_options(embed)
    embed.add_argument("--model", help="model id (default: the first model the server lists)")
    embed.add_argument("--dimensions", type=int, help="shorten the vectors (models configured as matryoshka only)")
    embed.add_argument("--json", action="store_true", help="print the whole answer (usage included)")
    embed.set_defaults(handler=_embed)

    count = sub.add_parser("count-tokens", help="count the tokens of a message's prompt on a running server "
                           "(Anthropic's count_tokens: the chat template included; nothing is generated)")  # fmt: skip
    count.add_argument("message", help="the user message")
    count.add_argument("--system", help="a system prompt")
    add_client_options(count)
    count.add_argument("--model", help="model id (default: the first model the server lists)")
    count.add_argument("--json", action="store_true", help="print the whole answer")
    count.set_defaults(handler=_count_tokens)
