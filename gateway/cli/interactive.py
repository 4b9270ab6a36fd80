"""``inferctl chat --interactive``: a conversation on the terminal, streamed, with its history.

Lines starting with ``/`` are commands (``/help`` lists them); any other line
is the next user message, sent with the whole conversation so far. Ctrl-C
while an answer streams closes that stream (the server stops generating it)
and forgets the question, but the session goes on; Ctrl-C at the prompt
clears the line; Ctrl-D (end of input) or ``/exit`` ends the session. Line
editing and recall come from ``readline`` where Python has it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import httpx
from httpx_sse import connect_sse

from inferflux.gateway.cli.client import connect, raise_for_error, stream_payloads
from inferflux.gateway.cli.common import EXIT_OK, ClientError, print_error

PROMPT = "you> "
HELP = """commands:
  /reset          forget the conversation (the system prompt stays)
  /model NAME     talk to another model from now on
  /system TEXT    set the system prompt (/system alone removes it)
  /history        show the conversation so far
  /exit           end the session (or Ctrl-D)
Ctrl-C cancels the answer being written; the session goes on."""


class Session:
    """The conversation: its model, system prompt and turns."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.args = args
        self.model = model
        self.system: str | None = args.system
        self.turns: list[dict[str, str]] = []

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def command(self, line: str) -> bool:
        """Run a ``/`` command; False when the session should end."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.turns.clear()
            print("(conversation forgotten)")
        elif name == "/model" and rest:
            self.model = rest
            print(f"(model: {rest})")
        elif name == "/system":
            self.system = rest or None
            print(f"(system prompt: {rest})" if rest else "(no system prompt)")
        elif name == "/history":
            for message in self.messages():
                print(f"{message['role']}: {message['content']}")
        else:
            print(HELP)
        return True

    def ask(self, client: httpx.Client, text: str) -> None:
        """Send ``text`` with the history and stream the answer; keep the turn only if it completed."""
        self.turns.append({"role": "user", "content": text})
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(), "stream": True,
                                "max_tokens": self.args.max_tokens}  # fmt: skip
        if self.args.temperature is not None:
            body["temperature"] = self.args.temperature
        answer: list[str] = []
        try:
            with connect_sse(client, "POST", "/v1/chat/completions", json=body) as events:
                raise_for_error(events.response)
                for payload in stream_payloads(events):
                    for choice in payload.get("choices", []):
                        piece = str((choice.get("delta") or {}).get("content") or "")
                        answer.append(piece)
                        print(piece, end="", flush=True)
            print()
        except KeyboardInterrupt:  # leaving the with-block closed the stream: the server stops generating
            print("\n(answer cancelled)", flush=True)
            self.turns.pop()
            return
        except ClientError as exc:
            print()
            print_error(str(exc))
            self.turns.pop()
            return
        self.turns.append({"role": "assistant", "content": "".join(answer)})


def _read_line() -> str | None:
    """The next line from the user; None at end of input. Ctrl-C at the prompt: an empty line."""
    try:
        return input(PROMPT)
    except EOFError:
        print()
        return None
    except KeyboardInterrupt:
        print()
        return ""


def run(args: argparse.Namespace, pick_model: Any) -> int:
    """The session's loop; ``pick_model(client, name)`` resolves ``--model`` (or the server's first)."""
    try:
        import readline  # noqa: F401  (line editing and recall for input(), where available)
    except ImportError:
        pass
    with connect(args) as client:
        session = Session(args, pick_model(client, args.model))
        print(f"chatting with {session.model} at {args.url}; /help for commands, Ctrl-D to leave", flush=True)
        while True:
            line = _read_line()
            if line is None:
                return EXIT_OK
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not session.command(line):
                    return EXIT_OK
                continue
            try:
                session.ask(client, line)
            except httpx.HTTPError as exc:  # the server went away: say so and let the user retry or leave
                print_error(f"cannot reach {args.url}: {exc}")
            sys.stdout.flush()
