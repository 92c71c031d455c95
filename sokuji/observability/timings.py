"""The per-model row buffer of request Timelines, and its bulk fold into stage histograms.

Per-request stage timings are the hot part: ten ``Histogram.observe`` calls (each a locked
Python loop over the buckets) cost tens of microseconds a request. Instead, each request
appends one row to a per-model numpy buffer, and the buffer is folded into bucket counts and
sums in bulk (``searchsorted`` + ``bincount``) when it fills or when a reader asks. Three
readers share one fold, so they can never disagree: the Prometheus exporter (``metrics.py``:
the request and stage histograms), Triton's statistics extension (``stats.py``: the sums and
the cache counts) and the dashboard (``timeseries.py``: the raw rows, through ``tap``).
Recording, folding and reading all run on the event loop thread.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sokuji.core.request import STAGES, Stage, Timeline

LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOTAL_COLUMN = len(STAGES)
"""The column of a row that holds the request's total; the stages come before it, in
``STAGES`` order, and the flag column after it."""
FLAG_COLUMN = TOTAL_COLUMN + 1
_CACHE_COLUMN = STAGES.index(Stage.CACHE)


class TimingHistograms:
    """Histograms of one model's request stages (columns: each stage, then total), and the
    sums the Triton statistics are made of (``stats.StatsSnapshot``).

    A row holds nanoseconds, then a flag column: +1 the request was computed (it has an
    ``infer`` stage), +2 it consulted the response cache (it has a ``cache`` stage). So 2 is
    a cache hit (or an identical request awaited), 3 a miss, 1 a request without a cache.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.columns = TOTAL_COLUMN + 1
        self._bounds = np.asarray(LATENCY_BUCKETS_S)
        self._buffer = np.empty((capacity, FLAG_COLUMN + 1), dtype=np.float64)
        self._pending = 0
        self.counts = np.zeros((self.columns, len(LATENCY_BUCKETS_S) + 1), dtype=np.int64)
        self.sums = np.zeros(self.columns, dtype=np.float64)
        self.sums_ns = np.zeros(self.columns, dtype=np.int64)
        self.kind_counts = np.zeros(4, dtype=np.int64)
        """Rows by flag value (see the class docstring)."""
        self.kind_cache_ns = np.zeros(4, dtype=np.int64)
        """The ``cache`` stage's nanoseconds, by flag value."""
        self.last_ns = 0
        """perf_counter_ns at which the last recorded request was answered."""
        self.tap: Callable[[np.ndarray], None] | None = None
        """Called with the rows about to be folded (a view: copy to keep): the dashboard's
        per-interval percentiles (``timeseries.py``). None: nobody listens."""

    def record(self, timeline: Timeline) -> None:
        durations = timeline.durations_ns
        row = self._buffer[self._pending]
        for i, stage in enumerate(STAGES):
            row[i] = durations.get(stage, 0)
        row[TOTAL_COLUMN] = timeline.total_ns
        row[FLAG_COLUMN] = (Stage.INFER in durations) + 2 * (Stage.CACHE in durations)
        self.last_ns = timeline.last_ns
        self._pending += 1
        if self._pending == len(self._buffer):
            self.flush()

    def flush(self) -> None:
        """Fold the pending rows (``tap`` sees them first); a no-op when there are none."""
        if not self._pending:
            return
        rows = self._buffer[:self._pending]
        if self.tap is not None:
            self.tap(rows)
        values_ns = rows[:, :self.columns]
        seconds = values_ns / 1e9
        bins = len(self._bounds) + 1
        for col in range(self.columns):
            index = np.searchsorted(self._bounds, seconds[:, col], side="left")  # value <= bound
            self.counts[col] += np.bincount(index, minlength=bins)
        self.sums += seconds.sum(axis=0)
        self.sums_ns += values_ns.astype(np.int64).sum(axis=0)
        kinds = rows[:, FLAG_COLUMN].astype(np.intp)
        self.kind_counts += np.bincount(kinds, minlength=4)
        self.kind_cache_ns += np.rint(np.bincount(
            kinds, weights=values_ns[:, _CACHE_COLUMN], minlength=4)).astype(np.int64)
        self._pending = 0
