"""A generation request as the engine sees it: prompt tokens, sampling, its timing, and the
channel its tokens go back through (engine thread -> event loop). It is also the caller's
handle (``core.model.Submission``): ``events()``, ``result()``, ``cancel()``."""

from __future__ import annotations

import asyncio
import codecs
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

from sokuji.core import timing
from sokuji.core.events import Delta, Event, EventQueue, Finish
from sokuji.core.model import Report
from sokuji.core.request import Priority

# Delta and Finish live with the event stream (core/events.py); named here too for the
# modules that take them with the rest of a generation.
__all__ = ["Delta", "Finish", "GenerationHandle", "GenerationRequest", "SamplingParams",
           "TextAssembler", "Timing", "now_ns"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    """End-of-generation tokens are masked out, and stop strings not looked for, until this
    many tokens are generated (vLLM's ``min_tokens``)."""
    ignore_eos: bool = False
    """End-of-generation tokens are masked out for the whole generation: it runs to
    ``max_tokens`` unless a stop string ends it (vLLM's and llama.cpp's ``ignore_eos``)."""

    @property
    def eog_banned_below(self) -> int:
        """End-of-generation tokens may not be sampled while fewer tokens than this have
        been generated (0: never banned, the common case, which costs one comparison)."""
        return self.max_tokens if self.ignore_eos else self.min_tokens


@dataclass
class Timing:
    """perf_counter_ns stamps of one generation; filled by the engine thread."""

    arrival_ns: int
    """The HTTP request arrived."""
    submitted_ns: int = 0
    """Parsed, templated, tokenised: handed to the engine."""
    admitted_ns: int = 0
    """A slot was given: queueing ends, prefill begins."""
    first_token_ns: int = 0
    end_ns: int = 0
    token_ns: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    reused_tokens: int = 0
    """Prompt tokens whose KV state came from the prefix cache."""
    prefix_lookup: str = "off"
    """hit | miss | off"""
    speculative: str = "off"
    """How it speculated: off | ngram | draft | off sampled (temperature > 0)."""
    steps: int = 0
    """Decode steps that gave it tokens (without speculation: one a token)."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    def speculation(self) -> str:
        """Drafted and accepted tokens, the acceptance rate, and tokens per step: the
        speed-up in steps (1.00 without speculation; in time it is less, as a step with drafts
        costs more: see ``speculative.py``)."""
        if self.speculative in ("off", "off sampled"):
            return self.speculative
        rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        per_step = len(self.token_ns) / self.steps if self.steps else 0.0
        return (f"{self.speculative} drafted {self.drafted_tokens} accepted "
                f"{self.accepted_tokens} rate {rate:.2f} tokens/step {per_step:.2f}")

    def timing_entries(self) -> list[timing.Entry]:
        ms = 1e-6
        prep = (self.submitted_ns - self.arrival_ns) * ms
        queue = (self.admitted_ns - self.submitted_ns) * ms if self.admitted_ns else 0.0
        prefill = (self.first_token_ns - self.admitted_ns) * ms if self.first_token_ns else 0.0
        decode = (self.end_ns - self.first_token_ns) * ms if self.first_token_ns else 0.0
        ttft = (self.first_token_ns - self.arrival_ns) * ms if self.first_token_ns else 0.0
        gaps = [(b - a) * ms for a, b in itertools.pairwise(self.token_ns)]
        itl = sum(gaps) / len(gaps) if gaps else 0.0
        return [
            ("preprocess", prep, None),
            ("queue", queue, None),
            ("prefill", prefill,
             f"{self.prompt_tokens - self.reused_tokens} of {self.prompt_tokens} prompt tokens"),
            ("decode", decode, f"{len(self.token_ns)} tokens"),
            ("ttft", ttft, None),
            ("itl", itl, "mean"),
            ("prefix-cache", None, f"{self.prefix_lookup} {self.reused_tokens} tokens"),
            ("speculative", None, self.speculation()),
            ("total", (self.end_ns - self.arrival_ns) * ms, None),
        ]

    def server_timing(self) -> str:
        return timing.render(self.timing_entries())


class GenerationRequest(EventQueue):
    """Created on the event loop; the engine thread fills ``timing`` and pushes events."""

    def __init__(self, model: str, prompt: list[int], params: SamplingParams,
                 loop: asyncio.AbstractEventLoop, arrival_ns: int,
                 priority: Priority = Priority.INTERACTIVE, deadline_ns: int | None = None,
                 tenant: str = "", timing: Timing | None = None) -> None:
        self.model = model
        self.tenant = tenant
        """Whose request this is: the prefix cache only reuses a tenant's own prompts."""
        self.prompt = prompt
        self.params = params
        self.priority = priority
        self.deadline_ns = deadline_ns
        if timing is None:
            timing = Timing(arrival_ns=arrival_ns)
        timing.prompt_tokens = len(prompt)
        self.timing = timing
        """Filled by the engine thread; a pipeline passes its own (its steps before this
        generation are part of the request's time)."""
        self.cancelled = False
        self._loop = loop
        super().__init__()

    def push(self, event: Event) -> None:
        """From the engine thread: the event goes to the loop."""
        self._loop.call_soon_threadsafe(self.put, event)

    def cancel(self) -> None:
        self.cancelled = True


class GenerationHandle(Protocol):
    """What the OpenAI endpoints read of a generation (``Api.GENERATE``): a
    ``GenerationRequest``, or any handle that streams like one (a router's, a pipeline's, an
    upstream's, a semantic-cache hit)."""

    @property
    def timing(self) -> Timing: ...

    @property
    def report(self) -> Report:
        """Read once the first events came (``core.model.Report``)."""

    async def next_events(self) -> list[Event]: ...

    def cancel(self) -> None: ...


class TextAssembler:
    """Tokens -> text: bytes decoded incrementally (a character can span tokens), and text
    that might begin a stop sequence held back until it cannot."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.floor = 0
        """A stop string counts only where it begins at or after this character: text added
        with ``add_unchecked`` (before ``min_tokens``) can never end the sequence."""

    def add_unchecked(self, piece: bytes) -> str:
        """Append a token's bytes without looking for stop strings (the sequence has not
        reached ``min_tokens`` yet); everything decoded so far is released."""
        self.text += self._decoder.decode(piece)
        self.floor = len(self.text)
        return self._release(len(self.text))

    def add(self, piece: bytes) -> str:
        """Append a token's bytes; returns the text that may be released now."""
        self.text += self._decoder.decode(piece)
        if self.stop:
            start = max(self.floor, self.sent - max(len(s) for s in self.stop))
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
                return self._release(len(self.text))
            return self._release(len(self.text) - self._held())
        return self._release(len(self.text))

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """At the end: whatever was held back (it did not become a stop)."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out


def now_ns() -> int:
    return time.perf_counter_ns()
