"""An encoder replica's service time, fitted to ``sokuji bench`` runs.

The model (``simulate.py`` runs it): a batch of b requests in a worker thread holds the
replica's core for ``base_ms + per_item_ms * b`` (times a factor from the measured spread);
a lone request at an idle replica runs on the event loop for ``inline_ms``; a refusal costs
``reject_ms``; each answer spends ``outside_ms`` outside the core. The runs pin it down:

1. **A lone request** (the run at the lowest load, best a closed loop of one client): its
   ``Server-Timing`` stages give ``inline_ms`` = every stage but ``queue`` and ``batch``
   (waiting); of that, ``infer`` is the runtime and the rest the server's own work per
   request (``overhead_ms``: decode, tokenise, hand-back, reply; a refusal is taken to cost
   as much). The client's mean latency less the server's total is
   ``outside_ms``. Its latency samples give the spread: each sample's distance from the
   mean is split between the core and the outside as the slowest 1%'s is (their stages
   against the mean's), so a client's hiccup is not taken for a slow batch.
2. **Capacity**: every run whose throughput the server limited (a closed loop of more than
   one client; an open loop with refusals or answers short of the offered rate) is
   simulated as it was run (same clients or arrivals, same queue bound), and ``base_ms``
   and ``per_item_ms`` are solved for so that the simulated throughputs are the measured
   ones (``_solve``). Two such runs at different batch sizes (e.g. concurrency 4 and 48)
   give both; with one, a batch of one in a worker is taken to cost ``inline_ms`` (it costs
   a little more: the hand-offs between threads), which underestimates small batches.
3. **Under open-loop load** the time outside the server's stages grows (here from ~0.8 ms
   at concurrency 1 to ~1.1-1.6 ms: the request waits in its socket while the core runs a
   batch; the client reads a batch's answers one after another): an open-loop run below
   capacity, if given, measures it (``outside_load_ms``, added to every simulated answer).
4. **The batcher's settings**: ``max_batch_size`` and the queue bound, from ``--stats``
   (the server's ``/config``) or flags, else the schema's defaults (noted).

With no server-limited run, batching is assumed to save nothing (``base_ms`` 0: every item
costs ``inline_ms``), a pessimistic plan, and a note says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sokuji.bench.schedule import Arrivals
from sokuji.config import ModelConfig
from sokuji.errors import ConfigError
from sokuji.plan import simulate
from sokuji.plan.inputs import Run, ServerInfo

_DEFAULTS = ModelConfig(name="-")
WAIT_STAGES = ("queue", "batch")
RUNTIME_STAGE = "infer"


@dataclass(frozen=True)
class EncoderFit:
    base_ms: float
    per_item_ms: float
    """A batch of b in a worker thread holds the core ``base_ms + per_item_ms * b``; per item:
    the runtime's share and the server's own work per request."""
    inline_ms: float
    """A lone request at an idle replica (run on the event loop): the stages' time."""
    overhead_ms: float
    """The server's own work per request (part of ``per_item_ms``), from the stages."""
    outside_ms: float
    """Mean time outside the server's core (its samples: ``outside``)."""
    spread: np.ndarray
    max_batch: int
    queue_depth: int
    anchor: str
    capacity_runs: tuple[str, ...]
    notes: tuple[str, ...] = ()
    outside: np.ndarray = field(default_factory=lambda: np.zeros(1))
    server_share_of_spread: float = 1.0
    reject_ms: float = 0.0
    """The core's time for a refusal (429)."""
    outside_load_ms: float = 0.0
    """Added to ``outside`` under open-loop load (from an open-loop run below capacity)."""
    calibration_run: str | None = None
    scale: dict[int, float] = field(default_factory=dict)
    """A variant's runtime time over the measured one, by batch size (``variants.py``)."""

    def runtime_ms(self, b: int) -> float:
        """The runtime's share of a batch of b (the rest is the server's work per request)."""
        return self.base_ms + (self.per_item_ms - self.overhead_ms) * b

    def service(self) -> simulate.Service:
        table = np.zeros(self.max_batch + 1)
        for b in range(1, self.max_batch + 1):
            table[b] = self.runtime_ms(b) * _scaled(self.scale, b) + self.overhead_ms * b
        inline = (self.inline_ms - self.overhead_ms) * _scaled(self.scale, 1) + self.overhead_ms
        return simulate.Service(np.maximum(table, 1e-6) * (np.arange(len(table)) > 0),
                                simulate.normalised(self.spread), max(inline, 1e-6),
                                self.reject_ms)

    @property
    def open_outside(self) -> np.ndarray:
        """Time outside the core per request under an open loop (ms samples)."""
        return self.outside + self.outside_load_ms

    def capacity_rps(self) -> float:
        return self.service().capacity_rps()

    def as_dict(self) -> dict[str, Any]:
        return {"base_ms": self.base_ms, "per_item_ms": self.per_item_ms,
                "inline_ms": self.inline_ms, "overhead_ms": self.overhead_ms,
                "outside_ms": self.outside_ms, "reject_ms": self.reject_ms,
                "outside_load_ms": self.outside_load_ms,
                "calibration_run": self.calibration_run,
                "batch_of_one_ms": self.base_ms + self.per_item_ms,
                "max_batch_size": self.max_batch, "queue_depth": self.queue_depth,
                "capacity_rps": self.capacity_rps(),
                "spread": {"samples": len(self.spread),
                           "p99_over_mean": float(np.percentile(self.spread, 99)),
                           "server_share": self.server_share_of_spread,
                           "outside_p99_ms": float(np.percentile(self.outside, 99))},
                "anchor": self.anchor, "capacity_runs": list(self.capacity_runs),
                "notes": list(self.notes)}


def _scaled(scale: dict[int, float], b: int) -> float:
    """The scale at b, interpolated on log(b) between the sizes given (flat beyond)."""
    if not scale:
        return 1.0
    sizes = sorted(scale)
    return float(np.interp(math.log(b), [math.log(s) for s in sizes],
                           [scale[s] for s in sizes]))


@dataclass(frozen=True)
class Sim:
    """How long and how often to simulate (the planner's accuracy against its time)."""

    seconds: float = 60.0
    warmup_s: float = 5.0
    seeds: int = 4
    requests: int = 40_000
    """Aim per prediction, over all seeds (p99 from ~400 tail requests); bounds seconds."""

    def seconds_for(self, rate: float) -> float:
        if rate <= 0:
            return self.seconds
        return float(min(600.0, max(self.seconds, self.requests / (self.seeds * rate))))


def _anchor(runs: list[Run]) -> Run:
    lone = [r for r in runs if r.mode == "closed" and r.concurrency == 1]
    if lone:
        return max(lone, key=lambda r: r.ok)
    light = [r for r in runs if not r.server_bound]
    if not light:
        raise ConfigError("no run at low load: add a `sokuji bench --concurrency 1` result "
                          "(the time of a lone request anchors the fit)")
    return min(light, key=lambda r: r.throughput_rps)


def _latencies(run: Run) -> np.ndarray:
    """The run's latency samples, or, without them, the distribution its percentiles draw."""
    if len(run.samples_ms) >= 50:
        return run.samples_ms
    lat = run.latency_ms
    points = [(0.0, lat.get("min", lat["p50"])), (0.5, lat["p50"]), (0.9, lat.get("p90")),
              (0.95, lat.get("p95")), (0.99, lat["p99"]), (0.999, lat.get("p99_9")),
              (1.0, lat.get("max", lat["p99"]))]
    qs, vs = zip(*[(q, v) for q, v in points if v is not None], strict=True)
    return np.interp((np.arange(2000) + 0.5) / 2000, qs, vs)


def _work(stages: dict[str, float]) -> float:
    return sum(v for k, v in stages.items() if k not in WAIT_STAGES)


def _split(run: Run, lone_ms: float, outside_ms: float) -> tuple[np.ndarray, np.ndarray, float]:
    """A lone request's latencies split into the core's time (as relative factors) and the
    time outside (ms): each sample's distance from the mean is shared between the two as the
    slowest 1%'s is (their stages against the mean's: the server's share of the tail).
    Returns (spread, outside samples, the server's share)."""
    lat = _latencies(run)
    share = 1.0
    if run.stages_ms and run.tail_stages_ms and run.tail_latency_ms:
        extra = run.tail_latency_ms - float(lat.mean())
        if extra > 0:
            share = min(1.0, max(0.0, (_work(run.tail_stages_ms) - _work(run.stages_ms))
                                 / extra))
    dev = lat - float(lat.mean())
    core = np.maximum(lone_ms + share * dev, 0.2 * lone_ms)
    outside = np.maximum(outside_ms + (1 - share) * dev, 0.0)
    return simulate.normalised(core), outside, share


def _measured(run: Run, fit: EncoderFit, sim: Sim) -> simulate.Figures:
    """``run``'s load, simulated under ``fit``."""
    service = fit.service()
    if run.mode == "closed":
        return simulate.closed_load(run.concurrency or 1, service, max_batch=fit.max_batch,
                                    outside_ms=fit.outside, seconds=30.0, seeds=2)
    assert run.rate is not None
    try:
        arrivals = Arrivals(run.arrivals)
    except ValueError:
        arrivals = Arrivals.POISSON
    return simulate.poisson_load(run.rate, service, max_batch=fit.max_batch,
                                 queue_depth=fit.queue_depth, outside_ms=fit.open_outside,
                                 seconds=min(sim.seconds, 30.0), warmup_s=2.0, seeds=2,
                                 arrivals=arrivals, burstiness=run.burstiness)


def fit_encoder(runs: list[Run], server: ServerInfo | None = None, *,
                max_batch: int | None = None, queue_depth: int | None = None,
                sim: Sim | None = None,
                progress: Callable[[str], None] = lambda _: None) -> EncoderFit:
    """Fit the model to ``runs`` (one model's, not streaming)."""
    sim = sim or Sim()
    notes: list[str] = []
    info = server or ServerInfo(source="")
    mb = max_batch or info.max_batch_size
    if mb is None:
        mb = _DEFAULTS.max_batch_size
        notes.append(f"max_batch_size not given (--stats or --max-batch-size): the default "
                     f"{mb} assumed")
    depth = queue_depth or info.queue_depth
    if depth is None:
        depth = _DEFAULTS.max_queue_depth
        notes.append(f"queue bound not given (--stats or --max-queue-depth): the default "
                     f"{depth} assumed")
    if info.instances and info.instances > 1:
        notes.append(f"the model runs {info.instances} instances; the simulation treats "
                     "the replica as one batch at a time (capacity is fitted as measured)")
    anchor = _anchor(runs)
    stages = anchor.stages_ms
    if stages and RUNTIME_STAGE in stages:
        server_ms = sum(stages.values())
        lone = server_ms - sum(stages.get(s, 0.0) for s in WAIT_STAGES)
        overhead = max(0.0, lone - stages[RUNTIME_STAGE])
        outside = max(0.0, anchor.latency_ms["mean"] - server_ms)
    else:
        lone, overhead, outside = anchor.latency_ms["mean"], 0.0, 0.0
        notes.append(f"{anchor.label}: no Server-Timing stages; the whole latency of a lone "
                     "request is taken as the core's time (pessimistic)")
    if anchor.mode == "open":
        notes.append(f"anchor {anchor.label} is an open loop: its queueing counts as "
                     "service time (a closed loop of one client anchors better)")
    spread, outside_samples, share = _split(anchor, lone, outside)
    # A refusal: read, parsed, answered and its wake-up of the loop; measured at 0.25-0.55 ms
    # here, about a request's own work (its decode and encode stages alone: 0.11-0.14 ms).
    fit = EncoderFit(base_ms=0.0, per_item_ms=lone, inline_ms=lone, overhead_ms=overhead,
                     outside_ms=outside, spread=spread, max_batch=mb, queue_depth=depth,
                     anchor=anchor.label, capacity_runs=(), outside=outside_samples,
                     server_share_of_spread=share, reject_ms=overhead)
    bound = [r for r in runs if r.server_bound and r is not anchor]
    if not bound:
        notes.append("no run at capacity (a closed loop of many clients, or an open loop "
                     "past capacity): batching is assumed to save nothing (pessimistic)")
        return replace(fit, notes=tuple(notes))
    fit = _solve(fit, bound, notes, progress)
    light = [r for r in runs if r.mode == "open" and not r.server_bound and r.stages_ms
             and r is not anchor]
    if light:
        run = max(light, key=lambda r: r.throughput_rps)
        assert run.stages_ms is not None
        extra = max(0.0, run.latency_ms["mean"] - sum(run.stages_ms.values()) - outside)
        fit = replace(fit, outside_load_ms=extra, calibration_run=run.label)
    else:
        notes.append("no open-loop run below capacity: the time outside the server under "
                     "load is taken as at concurrency 1 (add a `sokuji bench --rate R` run at "
                     "about half the capacity)")
    return replace(fit, capacity_runs=tuple(r.label for r in bound), notes=tuple(notes))


def _solve(fit: EncoderFit, bound: list[Run], notes: list[str],
           progress: Callable[[str], None]) -> EncoderFit:
    """``base_ms`` and ``per_item_ms`` such that every server-bound run's simulated
    throughput is the measured one. Each round simulates the runs under the current values;
    a run's core time per answer, scaled by simulated / measured throughput, is what the
    batches it ran must have cost: batches x base + items x per_item (+ its lone inline
    requests and refusals at their own cost), one linear equation per run; least squares on
    relative errors gives the next values. With runs that all ran the same batch size, a
    lone request in a worker (base + per_item) is taken to cost what it costs inline."""
    lone = fit.inline_ms
    sim = Sim(seconds=20.0, seeds=2)
    for step in range(12):
        progress(f"fitting the service time (round {step + 1})")
        rows, rhs = [], []
        for run in bound:
            f = _measured(run, fit, sim)
            if f.throughput_rps <= 0:
                continue
            needed = f.core_ms_per_answer * f.throughput_rps / run.throughput_rps
            target = needed - lone * f.inline_per_answer - fit.reject_ms * f.refused_per_answer
            rows.append([f.batches_per_answer - f.inline_per_answer, 1 - f.inline_per_answer])
            rhs.append(max(target, 1e-3))
        per_batch = [r[0] / max(r[1], 1e-9) for r in rows]
        if not rows or max(per_batch) < 2 * min(per_batch):
            rows.append([1.0, 1.0])
            rhs.append(lone)
        a = np.asarray(rows) / np.asarray(rhs)[:, None]  # relative errors
        base, per_item = np.linalg.lstsq(a, np.ones(len(rhs)), rcond=None)[0]
        base, per_item = float(base), float(per_item)
        if per_item < 0.02 * lone:
            per_item = 0.02 * lone
        if base < 0:  # one cost per item, refitted alone
            base = 0.0
            per_item = float(np.mean([t / max(r[1], 1e-9) for r, t in zip(rows, rhs,
                                                                        strict=True)]))
        moved = abs(base - fit.base_ms) / lone + abs(per_item - fit.per_item_ms) / lone
        fit = replace(fit, base_ms=base, per_item_ms=per_item)
        if moved < 1e-3:
            break
    else:
        notes.append("the fit did not settle in 12 rounds: the runs disagree (were they of "
                     "the same server and settings?)")
    return fit


def check(fit: EncoderFit, runs: list[Run], sim: Sim) -> list[dict[str, Any]]:
    """Each input run beside its simulation: how well the model reproduces what it saw."""
    out = []
    for run in runs:
        got = _measured(run, fit, sim)
        out.append({"run": run.label, "measured": {
            "throughput_rps": run.throughput_rps, "p50_ms": run.latency_ms["p50"],
            "p99_ms": run.latency_ms["p99"]}, "simulated": {
            "throughput_rps": got.throughput_rps, "p50_ms": got.latency_ms.get("p50"),
            "p99_ms": got.latency_ms.get("p99")}})
    return out
