"""One replica of an encoder, simulated: a work-conserving batcher in front of one core.

The replica is what ``core/batcher.py`` does with one instance: when the core frees, the
requests that have arrived (up to ``max_batch`` of them, oldest first) go as one batch; an
idle replica starts a lone arrival at once, on the event loop (``core/inline.py``: no
hand-off to a worker thread, so it may cost less than a batch of one: ``inline_ms``); a
request that finds ``queue_depth`` others waiting is refused (429) at once. A batch of b
requests holds the core for ``Service``'s time for b (its mean for b, times a relative
factor drawn from the measured spread). That time includes the server's own work per
request (HTTP, parsing, tokenising, the hand-back, the reply): on a replica whose loop and
runtime share the cores, every request's work competes with the batches, so it is charged
to the batch that carries the request. A refusal costs ``reject_ms`` of the core. Each
answer's latency adds a draw of ``outside_ms``: the time a request spends outside the
server's core (network, the client), measured at low load (a constant, or samples).

Two drivers: an open loop (arrival times given, e.g. Poisson: what a replica sees behind a
load balancer that splits the traffic evenly) and a closed loop of ``concurrency`` clients
(each sends again when its answer arrives: what ``sokuji bench --concurrency`` does), used to
fit the service time to closed-loop measurements.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from sokuji.bench.schedule import Arrivals, intended_times


@dataclass(frozen=True)
class Service:
    """A batch's time on the core, in milliseconds: ``mean_ms[b]`` for b items (index 0
    unused), plus each of its requests' own deviation: a factor drawn from ``spread``
    (relative, mean 1) less 1, times a lone request's time. Per request, not per batch: what
    makes a request slow (a longer text, a collection, a hiccup) comes with each request, so
    a batch of 8 meets 8 chances of it. A lone request at an idle replica takes
    ``inline_ms`` (None: ``mean_ms[1]``) plus its deviation; a refusal (429) takes
    ``reject_ms``."""

    mean_ms: np.ndarray
    spread: np.ndarray
    inline_ms: float | None = None
    reject_ms: float = 0.0

    @classmethod
    def linear(cls, base_ms: float, per_item_ms: float, max_batch: int,
               spread: np.ndarray | None = None, inline_ms: float | None = None) -> Service:
        sizes = np.arange(max_batch + 1, dtype=np.float64)
        mean = np.maximum(base_ms + per_item_ms * sizes, 1e-6)
        mean[0] = 0.0
        return cls(mean, np.ones(1) if spread is None else normalised(spread), inline_ms)

    @property
    def max_batch(self) -> int:
        return len(self.mean_ms) - 1

    def capacity_rps(self, max_batch: int | None = None) -> float:
        """Requests a second with every batch full (a queue that never empties)."""
        b = min(max_batch or self.max_batch, self.max_batch)
        return float(b / self.mean_ms[b] * 1e3)


def normalised(values: np.ndarray) -> np.ndarray:
    """Positive factors with mean 1 (a value at or below zero becomes a small positive one)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0 or float(v.mean()) <= 0:
        return np.ones(1)
    v = np.maximum(v, 0.05 * float(v.mean()))
    return v / float(v.mean())


@dataclass(frozen=True)
class Outcome:
    """What happened to each request of a simulated run."""

    arrival_s: np.ndarray
    done_s: np.ndarray
    """When the replica finished it (closed loop: when it was back at its client); NaN:
    refused."""
    latency_s: np.ndarray
    """done - arrival + outside (NaN: refused)."""
    batch_sizes: np.ndarray
    busy_s: float
    inline: int = 0
    """Lone requests run at an idle replica (``inline_ms``)."""


Outside = float | np.ndarray
"""Milliseconds outside the server per request: a constant, or samples to draw from."""


def _draws(values: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    if len(values) == 1:
        return np.full(n, float(values[0]))
    return values[rng.integers(0, len(values), n)]


def _outside_s(outside_ms: Outside, rng: np.random.Generator, n: int) -> np.ndarray:
    return _draws(np.atleast_1d(np.asarray(outside_ms, dtype=np.float64)), rng, n) / 1e3


class _Deviations:
    """Each request's own deviation in ms, drawn in advance; the sum over the next b."""

    def __init__(self, service: Service, rng: np.random.Generator, n: int) -> None:
        unit = service.mean_ms[1] if service.inline_ms is None else service.inline_ms
        if len(service.spread) == 1:
            self.cum = np.zeros(n + 1)
        else:
            dev = (_draws(service.spread, rng, n) - 1.0) * unit
            self.cum = np.concatenate(([0.0], np.cumsum(dev)))
        self.k = 0

    def take(self, b: int) -> float:
        k, n = self.k, len(self.cum) - 1
        if k + b > n:
            k = 0
        self.k = k + b
        return float(self.cum[k + b] - self.cum[k])


def _run_ms(mean_ms: float, deviation_ms: float) -> float:
    return max(mean_ms + deviation_ms, 0.2 * mean_ms)


def open_loop(arrival_s: np.ndarray, service: Service, *, max_batch: int,
              queue_depth: int | None = None, outside_ms: Outside = 0.0,
              seed: int = 0) -> Outcome:
    """Each request of ``arrival_s`` (ascending seconds) through one replica."""
    n = len(arrival_s)
    max_batch = min(max_batch, service.max_batch)
    done = np.full(n, np.nan)
    rng = np.random.default_rng(seed)
    devs = _Deviations(service, rng, n + 1)
    sizes: list[int] = []
    admitted = np.empty(n, dtype=np.int64)
    n_admitted = head = 0  # the queue is admitted[head:n_admitted]
    free_s, busy, i, n_inline = 0.0, 0.0, 0, 0
    mean = service.mean_ms
    inline = mean[1] if service.inline_ms is None else service.inline_ms
    depth = n if queue_depth is None else queue_depth
    reject_s = service.reject_ms / 1e3
    while i < n or head < n_admitted:
        idle = head == n_admitted and arrival_s[i] > free_s
        if idle:
            free_s = float(arrival_s[i])  # idle until the next arrival
        j = int(np.searchsorted(arrival_s, free_s, side="right"))
        if j > i:  # arrivals while the core was busy (or at this instant) join the queue
            room = max(0, depth - (n_admitted - head))
            take = min(j - i, room)
            admitted[n_admitted:n_admitted + take] = np.arange(i, i + take)
            n_admitted += take
            extra = (j - i - take) * reject_s
            free_s += extra
            busy += extra
            i = j
        if head == n_admitted:
            continue
        b = min(n_admitted - head, max_batch)
        lone = idle and b == 1
        run_s = _run_ms(inline if lone else mean[b], devs.take(b)) / 1e3
        n_inline += lone
        free_s += run_s
        busy += run_s
        done[admitted[head:head + b]] = free_s
        head += b
        sizes.append(b)
    return Outcome(arrival_s, done, done - arrival_s + _outside_s(outside_ms, rng, n),
                   np.asarray(sizes, dtype=np.int64), busy, n_inline)


def closed_loop(concurrency: int, service: Service, *, max_batch: int, seconds: float,
                outside_ms: Outside = 0.0, seed: int = 0) -> Outcome:
    """``concurrency`` clients for ``seconds``: each sends at once, then again as soon as its
    answer is back (a draw of ``outside_ms`` after the replica finished it)."""
    max_batch = min(max_batch, service.max_batch)
    rng = np.random.default_rng(seed)
    devs = _Deviations(service, rng, 1 << 16)
    back = _outside_s(outside_ms, rng, 1 << 14)
    ready = [(0.0, c) for c in range(concurrency)]  # (send time, client)
    heapq.heapify(ready)
    queue: list[float] = []
    arrivals: list[float] = []
    dones: list[float] = []
    sizes: list[int] = []
    free_s, busy, n_inline = 0.0, 0.0, 0
    mean = service.mean_ms
    inline = mean[1] if service.inline_ms is None else service.inline_ms
    idle = True
    while free_s < seconds:
        while ready and ready[0][0] <= free_s:
            queue.append(heapq.heappop(ready)[0])
        if not queue:
            free_s, idle = ready[0][0], True
            continue
        b = min(len(queue), max_batch)
        batch, queue = queue[:b], queue[b:]
        lone = idle and b == 1
        run_s = _run_ms(inline if lone else mean[b], devs.take(b)) / 1e3
        n_inline += lone
        idle = False
        free_s += run_s
        busy += run_s
        sizes.append(b)
        for sent in batch:
            back_s = float(back[len(dones) % len(back)])
            arrivals.append(sent)
            dones.append(free_s + back_s)
            heapq.heappush(ready, (free_s + back_s, 0))
    a, d = np.asarray(arrivals), np.asarray(dones)
    return Outcome(a, d, d - a, np.asarray(sizes, dtype=np.int64), busy, n_inline)


@dataclass(frozen=True)
class Figures:
    """A simulated load's figures, as ``sokuji bench`` would report them."""

    rate: float
    throughput_rps: float
    latency_ms: dict[str, float]
    refused_share: float
    mean_batch: float
    """The batch a request rode in, on average (batches weighted by their requests)."""
    busy_share: float
    batches_per_answer: float = 0.0
    inline_per_answer: float = 0.0
    refused_per_answer: float = 0.0
    core_ms_per_answer: float = 0.0
    """The core's time (batches and refusals) per answered request, over whole runs."""

    def as_dict(self) -> dict[str, object]:
        return {"rate": self.rate, "throughput_rps": self.throughput_rps,
                "latency_ms": self.latency_ms, "refused_share": self.refused_share,
                "mean_batch": self.mean_batch, "busy_share": self.busy_share}


PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p99_9": 99.9}


def latency_figures(latency_s: np.ndarray) -> dict[str, float]:
    """Mean, percentiles (nearest rank, as an HDR histogram reports them) and max, in ms."""
    lat = np.sort(latency_s[np.isfinite(latency_s)]) * 1e3
    if len(lat) == 0:
        return {}
    out = {"mean": float(lat.mean())}
    for key, p in PERCENTILES.items():
        out[key] = float(lat[min(len(lat) - 1, int(np.ceil(p / 100 * len(lat))) - 1)])
    out["max"] = float(lat[-1])
    return out


def figures(outcomes: list[Outcome], rate: float, warmup_s: float) -> Figures:
    """Pooled over runs (seeds): requests sent after ``warmup_s`` count, as in a bench run."""
    lat, ok, sent, window, sizes, busy, span = [], 0, 0, 0.0, [], 0.0, 0.0
    answers = sum(int(np.isfinite(o.done_s).sum()) for o in outcomes)
    refused = sum(int((~np.isfinite(o.done_s)).sum()) for o in outcomes)
    inline = sum(o.inline for o in outcomes)
    for o in outcomes:
        keep = o.arrival_s >= warmup_s
        sent += int(keep.sum())
        ok_mask = keep & np.isfinite(o.done_s)
        ok += int(ok_mask.sum())
        lat.append(o.latency_s[ok_mask])
        if ok_mask.any():
            window += float(np.nanmax(o.done_s[ok_mask]) - o.arrival_s[keep].min())
        sizes.append(o.batch_sizes)
        busy += o.busy_s
        span += float(np.nanmax(o.done_s)) if np.isfinite(o.done_s).any() else 0.0
    all_sizes = np.concatenate(sizes) if sizes else np.zeros(0)
    # The size a request saw: batches weighted by the requests they carried.
    mean_batch = float((all_sizes ** 2).sum() / all_sizes.sum()) if all_sizes.sum() else 0.0
    per = 1 / answers if answers else 0.0
    return Figures(rate=rate, throughput_rps=ok / window if window > 0 else 0.0,
                   latency_ms=latency_figures(np.concatenate(lat) if lat else np.zeros(0)),
                   refused_share=1 - ok / sent if sent else 0.0, mean_batch=mean_batch,
                   busy_share=float(min(1.0, busy / span)) if span > 0 else 0.0,
                   batches_per_answer=len(all_sizes) * per, inline_per_answer=inline * per,
                   refused_per_answer=refused * per,
                   core_ms_per_answer=busy * 1e3 * per)


def poisson_load(rate: float, service: Service, *, max_batch: int, queue_depth: int | None,
                 outside_ms: Outside, seconds: float = 60.0,
                 warmup_s: float = 5.0, seeds: int = 4,
                 arrivals: Arrivals = Arrivals.POISSON, burstiness: float = 1.0,
                 first_seed: int = 0) -> Figures:
    """One replica at ``rate`` requests a second, pooled over ``seeds`` schedules."""
    outcomes = []
    for s in range(first_seed, first_seed + seeds):
        times = intended_times(rate, arrivals, 1000 + s, duration_s=warmup_s + seconds,
                               burstiness=burstiness)
        outcomes.append(open_loop(times, service, max_batch=max_batch, queue_depth=queue_depth,
                                  outside_ms=outside_ms, seed=s))
    return figures(outcomes, rate, warmup_s)


def closed_load(concurrency: int, service: Service, *, max_batch: int, outside_ms: Outside,
                seconds: float = 30.0, warmup_s: float = 2.0, seeds: int = 2) -> Figures:
    outcomes = [closed_loop(concurrency, service, max_batch=max_batch,
                            seconds=warmup_s + seconds, outside_ms=outside_ms, seed=s)
                for s in range(seeds)]
    return figures(outcomes, 0.0, warmup_s)
