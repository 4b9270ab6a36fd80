"""``inferctl chat --interactive`` on a pseudo-terminal against the live server: the conversation's history,
/system, /history, /reset, /model, Ctrl-C (cancels the answer being streamed, not the session; at the
prompt clears the line) and Ctrl-D (ends the session, exit status 0)."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import sys
import time
import warnings

import pytest

PROMPT = "you> "


class Terminal:
    """The child's side of a pseudo-terminal, read until a pattern shows (like pexpect's expect)."""

    def __init__(self, argv: list[str]) -> None:
        with warnings.catch_warnings():  # the child only execs: the live server's threads are not its concern
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal is its controlling one, so Ctrl-C is its SIGINT
            os.environ["TERM"] = "dumb"
            # As a terminal's shell starts a command: a run started in the background of a
            # non-interactive shell inherits SIGINT ignored, and Python keeps an ignored SIGINT.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(sys.executable, [sys.executable, "-m", "inferflux.gateway.cli", *argv])
        self.seen = ""  # everything read so far
        self.mark = 0  # where the next expect starts looking

    def expect(self, pattern: str, seconds: float = 60.0) -> str:
        """The text from the last match up to and including ``pattern``'s next match."""
        deadline = time.monotonic() + seconds
        regex = re.compile(pattern)
        while True:
            found = regex.search(self.seen, self.mark)
            if found:
                text, self.mark = self.seen[self.mark : found.end()], found.end()
                return text
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                pytest.fail(f"no {pattern!r} on the terminal; it shows:\n{self.seen[self.mark:]}")

    def _read(self, seconds: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], seconds)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.seen += data.decode(errors="replace").replace("\r\n", "\n")
        return bool(data)

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def line(self, text: str) -> None:
        self.send(text + "\r")

    def ask(self, text: str, seconds: float = 60.0) -> str:
        """Type a line at the prompt; what the session printed after its echo, up to the next prompt."""
        self.line(text)
        self.expect(re.escape(text) + "\n")
        return self.expect(PROMPT, seconds)[: -len(PROMPT)]

    def wait(self, seconds: float = 30.0) -> int:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._read(0.1)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        pytest.fail("the session did not end")

    def close(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def test_interactive_session(live_server: str, admin_key: str) -> None:
    term = Terminal(["chat", "--interactive", "--url", live_server, "--api-key", admin_key,
                     "--max-tokens", "200", "--temperature", "0"])  # fmt: skip  # the cancelled turn must outlast the Ctrl-C
    try:
        term.expect("chatting with smollm2-135m-instruct")
        term.expect(PROMPT)
        assert "(system prompt: You answer briefly.)" in term.ask("/system You answer briefly.")

        # A turn streams its answer and joins the history.
        answer = term.ask("Say hello.", 120)
        assert answer.strip()  # some text came back
        history = term.ask("/history")
        assert "system: You answer briefly." in history and "user: Say hello." in history
        assert "assistant: " in history

        # Ctrl-C while the answer streams: it stops, the question is forgotten, the session goes on.
        term.line("Write a very long story about a dragon and a knight.")
        term.expect("knight\\.\n")  # the echo of the line, then the answer starts
        term.expect(r"\S", 120)  # the first streamed text
        term.send("\x03")
        term.expect(r"\(answer cancelled\)")
        term.expect(PROMPT)
        history = term.ask("/history")
        assert "user: Say hello." in history and "dragon" not in history

        assert "(conversation forgotten)" in term.ask("/reset")
        history = term.ask("/history")
        assert "user:" not in history and "system: You answer briefly." in history

        # Another model: an error is one line and the session stays.
        assert "(model: no-such-model)" in term.ask("/model no-such-model")
        error = term.ask("hello")
        assert "inferctl: error: HTTP 404" in error and "Traceback" not in error
        assert "(model: smollm2-135m-instruct)" in term.ask("/model smollm2-135m-instruct")
        assert "/reset" in term.ask("/help")

        term.send("half a line\x03")  # Ctrl-C at the prompt: the line is dropped, a new prompt
        term.expect(PROMPT)
        term.send("\x04")  # Ctrl-D: the end of input ends the session
        assert term.wait() == 0
        assert "Traceback" not in term.seen
    finally:
        term.close()


def test_interactive_refuses_a_message(live_server: str, admin_key: str) -> None:
    from inferflux.gateway import cli

    assert cli.main(["chat", "hi", "--interactive", "--url", live_server, "--api-key", admin_key]) == 1
    assert cli.main(["chat", "--url", live_server, "--api-key", admin_key]) == 1  # neither a message nor -i
