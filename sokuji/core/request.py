"""The request as the core sees it, and its Timeline of stage stamps.

A Timeline is stamped with ``time.perf_counter_ns()`` at each stage boundary. Each stamp closes
the stage that ran since the previous stamp, so the stages tile the request's life without gaps
or overlaps and their sum equals ``total``. The ``Server-Timing`` header, the Prometheus
histograms and any trace are all derived from this one object.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from sokuji.core import timing


class Stage(enum.StrEnum):
    DECODE = "decode"            # read the body, parse it, validate it against the protocol
    CACHE = "cache"              # response-cache lookup (or waiting for an identical request)
    PREPROCESS = "preprocess"    # tokenise (before queueing: the batcher needs lengths)
    QUEUE = "queue"              # wait for a free model instance
    BATCH = "batch"              # wait for company once an instance is free
    INFER = "infer"              # collate + runtime, attributed to every request of the batch
    POSTPROCESS = "postprocess"  # hand back from the worker thread, split out this request's rows
    ENCODE = "encode"            # serialise the response body


STAGES: tuple[Stage, ...] = tuple(Stage)


class Priority(enum.IntEnum):
    """Lower runs first. Batch traffic ages into interactive after ``priority_aging_ms``."""

    INTERACTIVE = 0
    BATCH = 1
TOTAL = "total"
_PLAIN = timing.render([(s.value, 0.0, None) for s in STAGES] + [(TOTAL, 0.0, None)]).replace(
    "0.000", "%.3f")
"""``timing.render``'s output for entries without notes, as a format string."""


class Timeline:
    """Stage durations of one request, in nanoseconds, from a monotonic clock."""

    __slots__ = ("durations_ns", "last_ns", "notes", "start_ns")

    def __init__(self, start_ns: int | None = None) -> None:
        self.start_ns = time.perf_counter_ns() if start_ns is None else start_ns
        self.last_ns = self.start_ns
        self.durations_ns: dict[Stage, int] = {}
        self.notes: dict[Stage, str] = {}
        """A word about a stage, e.g. the cache's hit or miss; rendered as ``desc``."""

    def mark(self, stage: Stage, at_ns: int | None = None) -> int:
        """Close ``stage`` at ``at_ns`` (now by default); returns the stamp."""
        now = time.perf_counter_ns() if at_ns is None else at_ns
        self.durations_ns[stage] = self.durations_ns.get(stage, 0) + (now - self.last_ns)
        self.last_ns = now
        return now

    @property
    def total_ns(self) -> int:
        return self.last_ns - self.start_ns

    def as_ms(self) -> dict[str, float]:
        """Every stage in milliseconds (absent stages as 0), then ``total``."""
        out = {s.value: self.durations_ns.get(s, 0) / 1e6 for s in STAGES}
        out[TOTAL] = self.total_ns / 1e6
        return out

    def timing_entries(self) -> list[timing.Entry]:
        """Every stage in milliseconds with its note, then ``total``."""
        get, notes = self.durations_ns.get, self.notes
        entries: list[timing.Entry] = [(s.value, get(s, 0) / 1e6, notes.get(s)) for s in STAGES]
        entries.append((TOTAL, self.total_ns / 1e6, None))
        return entries

    def server_timing(self) -> str:
        """W3C ``Server-Timing`` header value, durations in milliseconds."""
        if self.notes:
            return timing.render(self.timing_entries())
        get = self.durations_ns.get  # the common case: one formatting call, no loop
        return _PLAIN % (*[get(s, 0) / 1e6 for s in STAGES], self.total_ns / 1e6)


@dataclass(frozen=True)
class Prepared:
    """An encoder request's inputs after preprocessing, ready to be batched.

    ``num_items`` rows, each needing ``length`` positions once padded; ``num_tokens`` is the
    unpadded count (reported as usage). ``group``: requests batch only with others of the
    same group (a tensor model's: the shapes of its inputs past the batch dimension); None
    for a model whose requests all batch together (texts: padded to the longest).
    """

    data: Any
    num_items: int
    length: int
    num_tokens: int
    group: Hashable = None


@dataclass(eq=False)
class InferenceRequest:
    """One call to one model: ``payload`` is what the runtime's ``preprocess`` returned.

    ``num_items`` counts toward ``max_batch_size``; ``length`` is the padded length its items
    need (tokens), so ``num_items * length`` is its share of a batch's token budget.
    """

    model: str
    payload: Any
    num_items: int
    length: int
    timeline: Timeline
    request_id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: Priority = Priority.INTERACTIVE
    deadline_ns: int | None = None
    """Absolute ``perf_counter_ns`` by which the request must have started, or None."""
    enqueued_ns: int = 0
    tenant: str = ""
    num_tokens: int = 0
    """Its unpadded input tokens (the handle's report: OpenAI usage)."""
    group: Hashable = None
    """Batches only with requests of the same group (``Prepared.group``)."""
    due_ns: int | None = None
    """With an SLO: by when it should be answered (``core/slo_admission.py``)."""
    predicted_s: float = 0.0
    """At admission by time: the predicted seconds to its answer (0: not predicted)."""
    inline: bool = True
    """May run on the event loop when its model is idle (``core/inline.py``); False when
    others are known to be on their way (``RequestContext.company``)."""
