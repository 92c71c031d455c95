"""The dashboard's live figures: once a second, each model's last interval, in a ring buffer.

A ``Sampler`` runs as one asyncio task on the event loop (started and stopped with the app's
lifespan). Each tick it reads what the server already keeps and turns the difference since
the previous tick into one point per model:

- throughput: answers, 5xx errors, 429 refusals and other 4xx per second (``sokuji_requests``);
- latency p50 / p95 / p99 of the requests answered in the interval, and the mean time per
  stage: from the rows ``TimingHistograms`` folds (``timings.py``; its ``tap`` hands them
  over before they become bucket counts, so the percentiles are exact, not bucket
  estimates, and a request costs nothing more); generators from each finished generation's
  ``Timing`` (``Metrics.on_generation``): end-to-end, TTFT, ITL, tokens/s, and their stages
  (preprocess, queue, prefill, decode);
- queue depth (``ServedModel.capacity()``), batches (executions and items from Triton's
  statistics counters; for a generator the engine's decode steps and sequences per step),
  response-cache (or prefix-cache) hit rate;
- the SLOs' status and error-budget burn, when the server has them (``metrics.slo``).

A point is serialised once, when it is taken; ``since(seq)`` joins the serialised points
after ``seq``, so the page's poll every second costs a few ``bytes.join``. The tick's own
cost is in each point (``tick_us``): tens to hundreds of microseconds once a second.
An answer holds at most ``MAX_BYTES`` of points (at least one), the oldest first: a page
that starts (15 minutes kept, ~1 KB a point with four models) asks again from where the
answer ended (``upto``) until ``more`` is false.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from sokuji.core.model import Api
from sokuji.core.request import STAGES
from sokuji.observability.timings import TOTAL_COLUMN

if TYPE_CHECKING:
    from sokuji.llm.request import Timing
    from sokuji.observability.metrics import Metrics
    from sokuji.repository.models import Model

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
KEEP = 900
"""Points kept: 15 minutes at one a second."""
MAX_BYTES = 128 * 1024
"""Points in one answer of ``since``, in bytes (one point more than this is still sent)."""
MAX_ROWS = 50_000
"""Requests per model and interval kept for the percentiles (the counts are exact anyway)."""
MAX_GENERATIONS = 5_000
GEN_STAGES = ("preprocess", "queue", "prefill", "decode")
_QUANTILES = (50, 95, 99)
_ONES = np.ones(1024)


class _Interval:
    """What one model's taps collected since the last tick."""

    __slots__ = ("gens", "seen", "stage_ns", "totals")

    def __init__(self) -> None:
        self.totals: list[np.ndarray] = []
        """The requests' totals (ns), for the percentiles (at most MAX_ROWS)."""
        self.stage_ns = np.zeros(TOTAL_COLUMN)
        """Every request's stages (ns), summed."""
        self.seen = 0
        self.gens: list[tuple[Timing, int, bool]] = []
        """Finished generations: timing, completion tokens, answered well."""

    def take_rows(self, rows: np.ndarray) -> None:
        n = len(rows)
        room = MAX_ROWS - self.seen
        if room > 0:
            self.totals.append(rows[:room, TOTAL_COLUMN].copy())
        ones = _ONES[:n] if n <= len(_ONES) else np.ones(n)
        self.stage_ns += ones @ rows[:, :TOTAL_COLUMN]  # (a column sum: ~6x .sum(0)'s speed)
        self.seen += n


class _Previous:
    """One model's cumulative counters at the last tick."""

    __slots__ = ("cache_hits", "cache_misses", "counts", "executions", "items", "rows",
                 "steps")

    def __init__(self) -> None:
        self.executions = self.items = self.cache_hits = self.cache_misses = 0
        self.steps = self.rows = 0
        self.counts: dict[int, int] = {}


def _ms(values_ns: np.ndarray) -> list[float]:
    """p50, p95, p99 of ``values_ns`` in milliseconds (sample quantiles: values that
    occurred, not interpolations)."""
    q = np.percentile(values_ns, _QUANTILES, method="inverted_cdf")
    return [round(float(v) / 1e6, 3) for v in q]


def _bins(counts: dict[int, int]) -> list[int]:
    """Batches by size in powers of two: [1], [2], [3-4], [5-8], ..."""
    out: list[int] = []
    for size, n in counts.items():
        i = max(0, (size - 1).bit_length())
        if i >= len(out):
            out.extend([0] * (i + 1 - len(out)))
        out[i] += n
    return out


class Sampler:
    """Takes a point a second (``start``/``stop`` on the event loop; ``tick`` is the whole
    work of one, callable directly) and answers ``since``."""

    def __init__(self, metrics: Metrics, models: Iterable[Model],
                 interval_s: float = INTERVAL_S, keep: int = KEEP) -> None:
        self.metrics = metrics
        self.models = {m.metric_name: m for m in models}
        self.interval_s = interval_s
        self.points: deque[tuple[int, bytes]] = deque(maxlen=keep)
        self.seq = 0
        self.boot = secrets.token_hex(6)
        """Names this run of the server: a page that sees it change starts over."""
        self._intervals = {name: _Interval() for name in self.models}
        self._previous = {name: _Previous() for name in self.models}
        self._statuses: dict[tuple[str, int], float] = {}
        self._deltas: dict[str, dict[int, int]] = {}
        """Answers in the interval by model, then HTTP status."""
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self._header = orjson.dumps({
            "boot": self.boot, "interval_s": interval_s, "stages": [s.value for s in STAGES],
            "gen_stages": list(GEN_STAGES),
            "models": [self._describe(name, m) for name, m in self.models.items()]})

    @staticmethod
    def _describe(name: str, model: Model) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "apis": [a.value for a in Api if a in model.apis],
                               "runtime": model.config.runtime}
        if model.served.batches:
            out["max_batch_size"] = model.config.max_batch_size
        return out

    # --- lifecycle ---------------------------------------------------------------------

    def attach(self) -> None:
        """Listen to the metrics' taps and take the counters as they are now (the first
        point then counts from here)."""
        for name, interval in self._intervals.items():
            hist = self.metrics.timings(name)
            if hist is not None:
                hist.flush()  # rows from before: not this interval's
                hist.tap = interval.take_rows
        self.metrics.on_generation = self._generation
        self._read_counters(time.perf_counter())

    def detach(self) -> None:
        for name in self._intervals:
            hist = self.metrics.timings(name)
            if hist is not None:
                hist.tap = None
        self.metrics.on_generation = None

    def start(self) -> None:
        self.attach()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dashboard")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.detach()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            due = max(due + self.interval_s, loop.time())  # late ticks are not caught up
            try:
                self.tick()
            except Exception:  # a dashboard bug must not stop the server (logged)
                self._failures += 1
                if self._failures in (1, 10, 100, 1000):
                    log.exception("dashboard sampler failed (%d times)", self._failures)

    def follow(self, name: str, model: Model | None) -> None:
        """The model ``name`` was loaded again (``model``, its versions with it) or unloaded
        (None): points read the model serving now, and hold no other."""
        for key in [k for k in self.models if k == name or k.startswith(f"{name}@")]:
            del self.models[key]
        for m in model.all() if model is not None else ():
            self.models[m.metric_name] = m
            if m.metric_name not in self._intervals:
                self._intervals[m.metric_name] = _Interval()
                self._previous[m.metric_name] = _Previous()
            hist = self.metrics.timings(m.metric_name)
            if hist is not None and self._task is not None:
                hist.tap = self._intervals[m.metric_name].take_rows

    # --- taking a point ----------------------------------------------------------------

    def _generation(self, model: str, timing: Timing, tokens: int, status: int) -> None:
        interval = self._intervals.get(model)
        if interval is not None and len(interval.gens) < MAX_GENERATIONS:
            interval.gens.append((timing, tokens, status == 200))

    def _read_counters(self, now: float) -> float:
        """Seconds since the last read; the request counters by (model, status) kept."""
        statuses: dict[tuple[str, int], float] = {}
        deltas: dict[str, dict[int, int]] = {}
        for family in self.metrics.requests.collect():
            for sample in family.samples:
                status = sample.labels.get("status", "")
                if sample.name.endswith("_total") and status.isdigit():
                    key = (sample.labels["model"], int(status))
                    statuses[key] = sample.value
                    delta = int(sample.value - self._statuses.get(key, 0.0))
                    if delta:
                        deltas.setdefault(key[0], {})[key[1]] = delta
        self._statuses, self._deltas = statuses, deltas
        elapsed, self._last = now - self._last, now
        return elapsed

    def tick(self) -> None:
        """Take one point: every model's interval since the last tick."""
        t0 = time.perf_counter_ns()
        models: dict[str, dict[str, Any]] = {}
        for name in self.models:  # the rows not yet folded: into this interval
            hist = self.metrics.timings(name)
            if hist is not None:
                hist.flush()
        elapsed = self._read_counters(time.perf_counter()) or self.interval_s
        for name, model in self.models.items():
            models[name] = self._model_point(name, model)
        point: dict[str, Any] = {"seq": self.seq + 1, "t": time.time_ns() // 1_000_000,
                                 "dt": round(elapsed, 6), "models": models}
        slo = getattr(self.metrics, "slo", None)
        if slo is not None:
            point["slo"] = slo.snapshot()
        point["tick_us"] = (time.perf_counter_ns() - t0) // 1000
        self.seq += 1
        self.points.append((self.seq, orjson.dumps(point, option=orjson.OPT_SERIALIZE_NUMPY)))

    def _model_point(self, name: str, model: Model) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ok = err = shed = rej = 0
        for status, delta in self._deltas.get(name, {}).items():
            if status == 200:
                ok += delta
            elif status == 429:
                shed += delta
            elif status >= 500:
                err += delta
            else:
                rej += delta
        out.update(ok=ok, err=err, shed=shed, rej=rej)
        interval = self._intervals[name]
        self._intervals[name] = fresh = _Interval()
        hist = self.metrics.timings(name)
        if hist is not None:
            hist.tap = fresh.take_rows
        self._latency(out, interval)
        if interval.gens:
            self._generations(out, interval.gens)
        try:
            cap = model.served.capacity()
            out.update(waiting=cap.num_waiting, running=cap.num_running,
                       queue_bound=cap.max_queue_depth)
        except Exception:  # noqa: BLE001 - one model's capacity() failing spoils no other figure
            out.update(waiting=None, running=None, queue_bound=None)
        self._batches(out, name, model)
        return out

    def _latency(self, out: dict[str, Any], interval: _Interval) -> None:
        if not interval.seen:
            return
        out["p50"], out["p95"], out["p99"] = _ms(np.concatenate(interval.totals))
        means = interval.stage_ns / (interval.seen * 1e6)
        out["stages"] = [round(float(v), 3) for v in means]
        out["n"] = interval.seen

    def _generations(self, out: dict[str, Any], gens: list[tuple[Timing, int, bool]]) -> None:
        out["tokens"] = sum(n for _, n, _ in gens)
        done = [t for t, _, ok in gens if ok and t.first_token_ns and t.end_ns]
        lookups = [t.prefix_lookup for t, _, _ in gens if t.prefix_lookup != "off"]
        if lookups:
            out["prefix_hit"] = round(lookups.count("hit") / len(lookups), 4)
        if not done:
            return
        e2e = np.fromiter((t.end_ns - t.arrival_ns for t in done), np.int64, len(done))
        ttft = np.fromiter((t.first_token_ns - t.arrival_ns for t in done), np.int64,
                           len(done))
        out["p50"], out["p95"], out["p99"] = _ms(e2e)
        out["ttft_p50"], _, out["ttft_p99"] = _ms(ttft)
        gaps = [np.diff(np.asarray(t.token_ns, dtype=np.int64)) for t in done
                if len(t.token_ns) > 1]
        if gaps:
            out["itl_p50"], _, out["itl_p99"] = _ms(np.concatenate(gaps))
        stages = np.array([(t.submitted_ns - t.arrival_ns,
                            t.admitted_ns - t.submitted_ns if t.admitted_ns else 0,
                            t.first_token_ns - t.admitted_ns if t.admitted_ns else 0,
                            t.end_ns - t.first_token_ns) for t in done], dtype=np.float64)
        out["gen_stages"] = [round(float(v), 3) for v in stages.mean(axis=0) / 1e6]
        out["n"] = out.get("n", 0) + len(done)

    def _batches(self, out: dict[str, Any], name: str, model: Model) -> None:
        prev = self._previous[name]
        engine = self.metrics.llm.engines.get(name)
        if engine is not None:  # a generator: decode steps and sequences per step
            steps, rows = engine.steps, engine.rows
            d_steps, d_rows = steps - prev.steps, rows - prev.rows
            prev.steps, prev.rows = steps, rows
            out["batches"] = d_steps
            out["batch_mean"] = round(d_rows / d_steps, 3) if d_steps else None
            return
        stats = self.metrics.model_stats(name)
        d_exec = stats.execution_count - prev.executions
        d_items = stats.inference_count - prev.items
        changed = {size: n - prev.counts.get(size, 0) for size, n in stats.batch_counts.items()
                   if n != prev.counts.get(size, 0)}
        hits = stats.cache_hit.count - prev.cache_hits
        misses = stats.cache_miss.count - prev.cache_misses
        prev.executions, prev.items = stats.execution_count, stats.inference_count
        prev.counts = stats.batch_counts
        prev.cache_hits, prev.cache_misses = stats.cache_hit.count, stats.cache_miss.count
        out["batches"] = d_exec
        out["batch_mean"] = round(d_items / d_exec, 3) if d_exec else None
        out["batch_max"] = max(changed) if changed else None
        out["batch_bins"] = _bins(changed)
        if hits or misses:
            out["cache_hit"] = round(hits / (hits + misses), 4)

    # --- reading ---------------------------------------------------------------------

    def since(self, seq: int | None, max_bytes: int = MAX_BYTES) -> bytes:
        """The page's document: what the page needs to draw (boot, models, stages), the
        newest ``seq`` there is, and the points after ``seq`` (None: from the oldest kept),
        oldest first, at most ``max_bytes`` of them (one point at least); ``upto``: the seq
        of the last one sent (``seq`` when none), to ask ``since`` next; ``more``: points
        after it remain. A ``seq`` beyond the newest sends none: a page of another run of
        the server sees ``boot`` change and starts over."""
        points = self.points
        start = 0 if seq is None else seq
        if points and start < points[0][0] - 1:  # older than what is kept: from the oldest
            start = points[0][0] - 1
        taken: list[bytes] = []
        size = 0
        upto = start if start <= self.seq else self.seq
        if points and start < self.seq:
            first = len(points) - (self.seq - start)  # seqs are consecutive in the deque
            for s, data in itertools.islice(points, first, None):
                if taken and size + len(data) > max_bytes:
                    break
                taken.append(data)
                size += len(data) + 1
                upto = s
        more = upto < self.seq
        return b"".join((self._header[:-1], b',"seq":', str(self.seq).encode(),
                         b',"upto":', str(upto).encode(),
                         b',"more":', b"true" if more else b"false",
                         b',"points":[', b",".join(taken), b"]}"))
