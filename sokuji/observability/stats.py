"""Per-model statistics in the shape of Triton's statistics extension, from the same Timeline.

Triton reports, per model version, cumulative counts and nanoseconds of ``success``,
``fail``, ``queue``, ``compute_input``, ``compute_infer``, ``compute_output``, ``cache_hit``
and ``cache_miss``, plus ``inference_count`` (items), ``execution_count`` (batches) and
executions by batch size. Sokuji's Timeline stages map onto them like this:

=================  ==================================================================
Triton             Sokuji (an encoder request)
=================  ==================================================================
success            every answered request: count, and its ``total`` (all stages)
queue              ``queue`` + ``batch`` (waiting for an instance, then for company)
compute_input      ``preprocess`` (tokenise)
compute_infer      ``infer`` (the batch's run, attributed in full to each request)
compute_output     ``postprocess`` (hand-back from the worker, this request's rows)
cache_hit          requests answered from the response cache (or by an identical
                   request in flight): count, and their ``cache`` stage
cache_miss         computed requests that consulted the cache: count, ``cache`` stage
fail               error replies for the model (any 4xx/5xx): count, arrival to reply
=================  ==================================================================

``decode`` and ``encode`` (HTTP body parsing and serialisation) are in ``success`` but in
none of the parts, so perf_analyzer prints them as its "overhead". As in Triton, the three
compute counts leave cache hits out and are always equal (perf_analyzer checks that).

A generation (runtime ``llama``) counts as one inference and one execution: compute_input
is arrival to hand-over to the engine (parse, chat template, tokenise), queue is waiting for
a sequence slot, compute_infer is prefill plus decode, compute_output is 0 (text streams out
as it is generated).

Everything here is plain integers updated on the event loop thread: no locks, no
per-request histogram work (the Timeline part is folded in bulk by ``timings.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sokuji.core.request import STAGES, Stage

if TYPE_CHECKING:
    from sokuji.observability.timings import TimingHistograms


@dataclass(frozen=True)
class Duration:
    count: int = 0
    ns: int = 0


@dataclass(frozen=True)
class StatsSnapshot:
    """One model version's cumulative statistics since start-up."""

    last_inference_ms: int
    """Wall-clock milliseconds since the epoch of the last success; 0: none yet."""
    inference_count: int
    execution_count: int
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    cache_hit: Duration
    cache_miss: Duration
    batch_counts: dict[int, int] = field(default_factory=dict)
    """Executions by batch size (items)."""


class ModelCounters:
    """What the Timeline rows do not hold: batches, failures, generations."""

    __slots__ = ("batch_counts", "executions", "fail_count", "fail_ns", "gen_infer_ns",
                 "gen_input_ns", "gen_ns", "gen_ok", "gen_queue_ns", "items", "last_ns")

    def __init__(self) -> None:
        self.executions = 0
        self.items = 0
        self.batch_counts: dict[int, int] = {}
        self.fail_count = 0
        self.fail_ns = 0
        self.gen_ok = 0
        self.gen_ns = 0
        self.gen_input_ns = 0
        self.gen_queue_ns = 0
        self.gen_infer_ns = 0
        self.last_ns = 0
        """perf_counter_ns of the last successful generation."""

    def batch(self, num_items: int) -> None:
        self.executions += 1
        self.items += num_items
        self.batch_counts[num_items] = self.batch_counts.get(num_items, 0) + 1

    def failure(self, duration_ns: int) -> None:
        self.fail_count += 1
        self.fail_ns += max(0, duration_ns)

    def generation(self, arrival_ns: int, submitted_ns: int, admitted_ns: int,
                   end_ns: int) -> None:
        """A generation that finished well (stamps from ``llm.request.Timing``)."""
        self.gen_ok += 1
        self.gen_ns += end_ns - arrival_ns
        self.gen_input_ns += max(0, submitted_ns - arrival_ns)
        if admitted_ns:
            self.gen_queue_ns += max(0, admitted_ns - submitted_ns)
            self.gen_infer_ns += max(0, end_ns - admitted_ns)
        self.last_ns = max(self.last_ns, end_ns)


def wall_ms(perf_ns: int) -> int:
    """A ``perf_counter_ns`` stamp as wall-clock milliseconds since the epoch (0 stays 0)."""
    if not perf_ns:
        return 0
    return (perf_ns + time.time_ns() - time.perf_counter_ns()) // 1_000_000


def snapshot(hist: TimingHistograms, counters: ModelCounters) -> StatsSnapshot:
    """Fold ``hist``'s pending rows, then read both into one snapshot."""
    hist.flush()
    ns = {stage: int(hist.sums_ns[i]) for i, stage in enumerate(STAGES)}
    answered = int(hist.kind_counts.sum())
    hits = int(hist.kind_counts[2])
    gen = counters.gen_ok
    ok, computed = answered + gen, answered - hits + gen
    return StatsSnapshot(
        last_inference_ms=wall_ms(max(hist.last_ns, counters.last_ns)),
        inference_count=counters.items + gen,
        execution_count=counters.executions + gen,
        success=Duration(ok, int(hist.sums_ns[-1]) + counters.gen_ns),
        fail=Duration(counters.fail_count, counters.fail_ns),
        queue=Duration(ok, ns[Stage.QUEUE] + ns[Stage.BATCH] + counters.gen_queue_ns),
        compute_input=Duration(computed, ns[Stage.PREPROCESS] + counters.gen_input_ns),
        compute_infer=Duration(computed, ns[Stage.INFER] + counters.gen_infer_ns),
        compute_output=Duration(computed, ns[Stage.POSTPROCESS]),
        cache_hit=Duration(hits, int(hist.kind_cache_ns[2])),
        cache_miss=Duration(int(hist.kind_counts[3]), int(hist.kind_cache_ns[3])),
        batch_counts=dict(counters.batch_counts))
