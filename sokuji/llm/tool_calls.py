"""The model's output parsed back into OpenAI's ``content`` + ``tool_calls``, whole
(``parse_tool_calls``) or as streamed chunk deltas (``ToolCallStream``), in the output
convention of a ``tools.ToolFormat`` (Hermes' by default: ``<tool_call>`` blocks of
``{"name": ..., "arguments": ...}``). Pure: no HTTP, no runtime. See docs/tools.md.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sokuji.llm.tools import HERMES, ToolFormat

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """``call_`` + 24 random letters and digits (143 bits, from ``secrets``)."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')
_WS = " \t\r\n"


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[dict[str, Any]]
    """OpenAI's ``message.tool_calls``: ``{id, type: "function", function: {name, arguments}}``
    with ``arguments`` the JSON text."""

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` when the answer calls tools and ended on its own (``stop``); the
        engine's reason otherwise (``length`` for one cut short)."""
        return "tool_calls" if self.tool_calls and reason == "stop" else reason


class ToolCallStream:
    """Generated text, in pieces as they come, -> OpenAI chat chunk deltas.

    ``feed(text)`` and ``finish()`` return a list of deltas, each one chunk's ``delta`` less the
    role: ``{"content": str}`` or ``{"tool_calls": [{"index", ...}]}``. A call's first delta
    carries ``index``, ``id``, ``type: "function"``, ``function.name`` and ``arguments: ""``, the
    next ones ``index`` and ``function.arguments`` fragments. The wrapper markup never reaches
    ``content``: text that may be the start of ``<tool_call>`` is held back until it is not,
    whitespace before and between calls is dropped, and a block cut short before its name is
    complete (``max_tokens``) is dropped. A closed block that turns out not to be a call
    (possible only without the grammar) is given back as content, markup included.
    ``result()`` is the whole answer (``parse_tool_calls`` is feed + finish + result)."""

    def __init__(self, fmt: ToolFormat = HERMES,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt, self.new_id = fmt, new_id
        self.state = "text"  # text | head | args | tail
        self.buf = ""
        self.pending_ws = self._ws_before = ""
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self._depth = 0
        self._in_str = self._esc = self._started = self._scalar = False

    # content
    def _text(self, out: list[dict[str, Any]], text: str) -> None:
        text = self.pending_ws + text
        body = text.rstrip(_WS)
        self.pending_ws = text[len(body):]
        if body:
            self.content.append(body)
            out.append({"content": body})

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self.buf += text
        while self.buf:
            before = (self.state, len(self.buf))
            getattr(self, "_step_" + self.state)(out)
            if (self.state, len(self.buf)) == before:
                break  # waiting for more text
        return out

    def _head_start(self) -> None:
        self._ws_before, self.pending_ws = self.pending_ws, ""  # back if it is no call
        self.state = "head"

    def _args_delta(self, out: list[dict[str, Any]], frag: str) -> None:
        if frag:
            self.calls[-1]["function"]["arguments"] += frag
            out.append({"tool_calls": [{"index": len(self.calls) - 1,
                                        "function": {"arguments": frag}}]})

    def _open_call(self, out: list[dict[str, Any]], name: str) -> None:
        call = {"id": self.new_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"],
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})

    def _step_text(self, out: list[dict[str, Any]]) -> None:
        k = self.buf.find(self.fmt.open)
        if k >= 0:
            self._text(out, self.buf[:k])
            self.buf = self.buf[k + len(self.fmt.open):]
            self._head_start()
            return
        hold = next((n for n in range(min(len(self.fmt.open) - 1, len(self.buf)), 0, -1)
                     if self.fmt.open.startswith(self.buf[-n:])), 0)
        emit, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        if emit:
            self._text(out, emit)

    def _step_head(self, out: list[dict[str, Any]]) -> None:
        m = _HEAD.match(self.buf)
        if m:
            self._open_call(out, json.loads(m.group(1)))
            self.buf = self.buf[m.end():]
            self.state = "args"
            self._depth, self._started = 0, False
            self._in_str = self._esc = self._scalar = False
            return
        k = self.buf.find(self.fmt.close)
        if k < 0:
            return  # wait: the head may still come, or the close
        body, self.buf = self.buf[:k], self.buf[k + len(self.fmt.close):]
        self.state = "text"
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("name"), str) and "arguments" in doc:
            args = doc["arguments"]
            self._open_call(out, doc["name"])
            self._args_delta(out, args if isinstance(args, str)
                             else json.dumps(args, ensure_ascii=False))
        else:
            self._text(out, self._ws_before + self.fmt.open + body + self.fmt.close)

    def _step_args(self, out: list[dict[str, Any]]) -> None:
        i, n, buf = 0, len(self.buf), self.buf
        start = 0
        done = False
        while i < n:
            c = buf[i]
            if not self._started:
                if c in _WS:
                    i += 1
                    start = i
                    continue
                self._started = True
                if c in "{[":
                    self._depth = 1
                elif c == '"':
                    self._in_str = True
                else:
                    self._scalar = True
                i += 1
                continue
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if self._depth == 0:
                        i += 1
                        done = True
                        break
            elif self._scalar:
                if c in ",}]" or c in _WS:
                    done = True
                    break
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    i += 1
                    done = True
                    break
            i += 1
        self._args_delta(out, buf[start:i])
        self.buf = buf[i:]
        if done:
            self.state = "tail"

    def _step_tail(self, out: list[dict[str, Any]]) -> None:
        k = self.buf.find(self.fmt.close)
        if k < 0:
            keep = len(self.fmt.close) - 1  # all but what may start the close is the call's end
            self.buf = self.buf[-keep:] if len(self.buf) > keep else self.buf
            return
        self.buf = self.buf[k + len(self.fmt.close):]
        self.state = "text"

    def finish(self) -> list[dict[str, Any]]:
        """The end of the text: what was held back, as content where it is content."""
        out: list[dict[str, Any]] = []
        if self.state == "text":
            rest = self.pending_ws + self.buf
            if rest.strip(_WS) or (rest and not self.calls):
                self.pending_ws = ""
                self.content.append(rest)
                out.append({"content": rest})
        # state "head": a call cut short before its name (max_tokens): dropped, not content
        self.buf = self.pending_ws = ""
        self.state = "text"
        return out

    def result(self) -> Parsed:
        content = "".join(self.content)
        return Parsed(content or None, [
            {**c, "function": dict(c["function"])} for c in self.calls])


def parse_tool_calls(text: str, fmt: ToolFormat = HERMES,
                     new_id: Callable[[], str] = new_call_id) -> Parsed:
    """A whole answer -> ``content`` (``None`` when there is none) and ``tool_calls``."""
    stream = ToolCallStream(fmt, new_id)
    stream.feed(text)
    stream.finish()
    return stream.result()
