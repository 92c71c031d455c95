"""The choices of one OpenAI completion as they are answered: one generation handle each
(``n`` > 1: the model's ``submit_choices``, sharing one prefill), their events merged in the
order they come, and each choice's answer built from them: its text and log-probabilities,
and with tools its ``content`` and ``tool_calls`` (``llm/tool_calls.ToolCallStream``: the call
markup never reaches ``content``; streamed as the openai SDK assembles tool-call deltas).

A model without ``submit_choices`` (an upstream, a router, a pipeline) serves ``n`` = 1
only: its ``prepare`` refused anything else by name.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sokuji.core.events import Delta, Event, Finish, TokenLogprob
from sokuji.errors import InvalidInput
from sokuji.llm.request import GenerationHandle


def submit(served: Any, prepared: Any, ctx: Any, n: int) -> list[GenerationHandle]:
    """One handle per choice."""
    if n == 1:
        return [served.submit(prepared, ctx)]
    many = getattr(served, "submit_choices", None)
    if many is None:
        raise InvalidInput(f"'n' {n} is not served by this model (one choice only)", param="n")
    return list(many(prepared, ctx))


class Merged:
    """The handles' events as they come: (choice index, event) pairs, at least one each call
    until every choice has finished. One handle costs nothing over reading it directly."""

    def __init__(self, gens: list[GenerationHandle]) -> None:
        self.gens = gens
        self.open = set(range(len(gens)))
        self._reads: dict[int, asyncio.Future[list[Event]]] = {}

    async def next_events(self) -> list[tuple[int, Event]]:
        if len(self.gens) == 1:
            events = await self.gens[0].next_events()
            if any(isinstance(e, Finish) for e in events):
                self.open.discard(0)
            return [(0, e) for e in events]
        for i in self.open:
            if i not in self._reads:
                self._reads[i] = asyncio.ensure_future(self.gens[i].next_events())
        done, _ = await asyncio.wait(self._reads.values(), return_when=asyncio.FIRST_COMPLETED)
        out: list[tuple[int, Event]] = []
        for i in sorted(self._reads):
            read = self._reads[i]
            if read not in done:
                continue
            del self._reads[i]
            for event in read.result():
                out.append((i, event))
                if isinstance(event, Finish):
                    self.open.discard(i)
        return out

    def cancel(self) -> None:
        for gen in self.gens:
            gen.cancel()
        for read in self._reads.values():
            read.cancel()


class Choice:
    """One choice's answer, built from its events."""

    def __init__(self, index: int, tools: bool) -> None:
        from sokuji.llm.tool_calls import ToolCallStream

        self.index = index
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish: Finish | None = None
        self.calls = ToolCallStream() if tools else None
        """With tools: the text parsed into content and tool calls as it comes."""

    def add(self, delta: Delta) -> list[dict[str, Any]]:
        """Take a delta; the chat chunk deltas it gives (content, or tool-call pieces)."""
        self.texts.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        if self.calls is None:
            return [{"content": delta.text}]
        return self.calls.feed(delta.text)

    def end(self, finish: Finish) -> list[dict[str, Any]]:
        """The finish; the last chunk deltas (text held back as a possible call's start)."""
        self.finish = finish
        return self.calls.finish() if self.calls is not None else []

    @property
    def reason(self) -> str:
        """Its finish reason, as OpenAI says it (``tool_calls`` for an answer that calls)."""
        assert self.finish is not None
        if self.calls is None:
            return self.finish.reason
        return self.calls.result().finish_reason(self.finish.reason)

    def message(self) -> dict[str, Any]:
        """The whole chat message."""
        if self.calls is None:
            return {"role": "assistant", "content": "".join(self.texts), "refusal": None}
        parsed = self.calls.result()
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content,
                                   "refusal": None}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return message
