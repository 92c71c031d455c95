"""A generation request as the engine sees it: prompt tokens, sampling, its timing, and the
channel its tokens go back through (engine thread -> event loop). It is also the caller's
handle (``core.model.Submission``): ``events()``, ``result()``, ``cancel()``."""

from __future__ import annotations

import asyncio
import codecs
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from sokuji.core import timing
from sokuji.core.events import Delta, Event, EventQueue, Finish
from sokuji.core.limits import Limit
from sokuji.core.model import Report
from sokuji.core.request import Priority
from sokuji.llm.sampling import SamplingConfig

# Delta and Finish live with the event stream (core/events.py); named here too for the
# modules that take them with the rest of a generation.
__all__ = ["STOP_BYTES", "STOP_LIMITS", "STOP_SEQUENCES", "Delta", "Finish",
           "GenerationHandle", "GenerationRequest", "SamplingParams", "TextAssembler",
           "Timing", "check_stops", "now_ns"]

STOP_SEQUENCES = Limit("stop", 4, "sequences", "stop sequences of one request (OpenAI's "
                       "bound)")
STOP_BYTES = Limit("stop.bytes", 512, "bytes", "UTF-8 bytes of one stop sequence")
"""Stop strings are looked for in every sequence's text at every token, on the engine
thread (``TextAssembler``: a few steps a character whatever their length, but each is held
and compiled per request). 512 bytes is over a hundred tokens of English; four 1 MB stops
cost 1.3 s of engine CPU a generation before issue 25. Fixed by the protocol, not by a
setting: the keys name the request's field. Every generator's ``limits`` state them."""
STOP_LIMITS = (STOP_SEQUENCES, STOP_BYTES)


def check_stops(stop: tuple[str, ...]) -> None:
    """``LimitExceeded`` (413) past ``STOP_SEQUENCES`` or ``STOP_BYTES``, before the engine
    sees them (the codec calls it, for every generator)."""
    STOP_SEQUENCES.check(len(stop), "'stop'")
    bound = STOP_BYTES.value
    for i, s in enumerate(stop):  # characters first: a long one is not encoded
        if len(s) > bound or len(s.encode("utf-8")) > bound:
            STOP_BYTES.check(len(s) if len(s) > bound else len(s.encode("utf-8")),
                             f"'stop[{i}]'")


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
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    """None: none reported; n: each token's and its n most likely alternatives'
    (``llm/sampling.py`` says which log-probabilities these are)."""

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            seed=self.seed, logprobs=self.logprobs)

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
        self.grammar: Any = None
        """Its output's compiled constraint (``llm/grammar.Compiled``), or None: each of its
        sequences walks a matcher of its own."""
        self.group: PrefillGroup | None = None
        """The choices (``n`` > 1) that share its prompt's one prefill, or None."""
        self._loop = loop
        super().__init__()

    def push(self, event: Event) -> None:
        """From the engine thread: the event goes to the loop."""
        self._loop.call_soon_threadsafe(self.put, event)

    def cancel(self) -> None:
        self.cancelled = True


class PrefillGroup:
    """The ``n`` choices of one request: the first (the leader) prefills the prompt; when it
    has, the engine keeps its KV state and its last prompt row's logits, and each other
    member starts from them (no prefill of its own: one prefill, n sequences). Filled by the
    engine thread only."""

    __slots__ = ("leader", "logits", "ready", "state")

    def __init__(self, leader: GenerationRequest) -> None:
        self.leader = leader
        self.ready = False
        """The leader prefilled (``state`` and ``logits`` are set) or ended before it
        (both None: each member prefills for itself)."""
        self.state: bytes | None = None
        self.logits: Any = None

    def waits(self, req: GenerationRequest) -> bool:
        """``req`` is a member that may not start yet (the leader is still prefilling)."""
        return req is not self.leader and not self.ready


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


class _Stop:
    """One stop string, looked for as text arrives (Knuth-Morris-Pratt): ``matched`` is the
    longest prefix of it the text ends with, so each character costs a few steps however
    long the stop string is (a search over the text's tail for each token cost time in its
    length times the text's: issue 25)."""

    __slots__ = ("fail", "matched", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        fail, k = [0] * len(text), 0
        for i in range(1, len(text)):
            while k and text[i] != text[k]:
                k = fail[k - 1]
            if text[i] == text[k]:
                k += 1
            fail[i] = k
        self.fail = fail
        """``fail[i]``: the longest proper prefix of ``text[:i + 1]`` that is also its
        suffix."""
        self.matched = 0

    def feed(self, c: str) -> bool:
        """One more character of the text; True when the stop string ends with it."""
        s, k = self.text, self.matched
        while k and s[k] != c:
            k = self.fail[k - 1]
        if s[k] == c:
            k += 1
        if k == len(s):
            self.matched = self.fail[k - 1]
            return True
        self.matched = k
        return False


class TextAssembler:
    """Tokens -> text: bytes decoded incrementally (a character can span tokens), and text
    that might begin a stop sequence held back until it cannot."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self._stops = [_Stop(s) for s in stop]
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
        for stop in self._stops:  # a stop must begin after this text
            stop.matched = 0
        return self._release(len(self.text))

    def add(self, piece: bytes) -> str:
        """Append a token's bytes; returns the text that may be released now."""
        start = len(self.text)
        self.text += self._decoder.decode(piece)
        if not self._stops:
            return self._release(len(self.text))
        text, cut = self.text, -1
        for stop in self._stops:  # the earliest-beginning one wins
            for i in range(start, len(text)):
                if stop.feed(text[i]):
                    begin = i + 1 - len(stop.text)
                    cut = begin if cut < 0 else min(cut, begin)
                    break
        if cut >= 0:
            self.text = text[:cut]
            self.stopped = True
            return self._release(cut)
        return self._release(len(text) - self._held())

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop."""
        return max(stop.matched for stop in self._stops)

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
