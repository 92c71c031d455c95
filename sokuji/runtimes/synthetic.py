"""A model with a known service-time distribution, for tests and capacity drills.

Options (``[models.options]``):
  base_ms      fixed cost of a batch (default 1.0)
  per_item_ms  added per item in the batch (default 0.0)
  distribution constant | exponential | lognormal (default constant); the base cost is drawn
               from it with mean ``base_ms`` (lognormal: ``sigma``, default 0.25)
  seed         seed of the draws (default 0)
  fail_on      a text: any batch holding an item equal to it raises (to test failure isolation)
  stall_ms, stall_after_batches
               once, the batch numbered ``stall_after_batches`` (1-based) takes ``stall_ms``
               longer: a server that stalls once, to test that a load generator sees it
  error_rate   each batch fails with this probability (0..1, default 0), drawn from ``seed``
  degrade_after_s, degrade_after_batches
               when the bad phase starts: this long after ``load()``, or after this many
               batches (whichever comes first; neither given: from the start). A version that
               degrades on purpose, to test that a canary rolls itself back
  degrade_error_rate
               the failure probability in the bad phase (instead of ``error_rate``)
  degrade_extra_ms
               added to every batch's service time in the bad phase

The options are ``SyntheticOptions``, checked when the config loads (``kinds/synthetic``).
A failing batch (``fail_on``, ``error_rate``, ``degrade_error_rate``) raises ``RuntimeFailed``
after its service time, as a real runtime fails after computing.

Output: FP32 ``[n, 1]``, the length of each text in characters.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from sokuji.config_types import Fraction, ZeroOrMore, ZeroOrMoreS, _Table
from sokuji.errors import RuntimeFailed
from sokuji.runtimes.base import ModelMetadata, Prepared, TensorSpec


class SyntheticOptions(_Table, frozen=True):
    """Runtime ``synthetic``'s options (the module's docstring says what each does). That
    ``degrade_after_*`` needs something to degrade is checked by its kind."""

    base_ms: ZeroOrMoreS = 1.0
    per_item_ms: ZeroOrMoreS = 0.0
    distribution: Literal["constant", "exponential", "lognormal"] = "constant"
    sigma: ZeroOrMoreS = 0.25
    seed: int = 0
    fail_on: str | None = None
    stall_ms: ZeroOrMoreS = 0.0
    stall_after_batches: ZeroOrMore = 0
    error_rate: Fraction = 0.0
    degrade_after_s: ZeroOrMoreS | None = None
    degrade_after_batches: ZeroOrMore | None = None
    degrade_error_rate: Fraction | None = None
    degrade_extra_ms: ZeroOrMoreS | None = None

    @property
    def degrades(self) -> bool:
        """Is there a bad phase at all?"""
        return self.degrade_error_rate is not None or self.degrade_extra_ms is not None


class SyntheticRuntime:
    def __init__(self, options: SyntheticOptions | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        o = options or SyntheticOptions()
        self.base_ms = o.base_ms
        self.per_item_ms = o.per_item_ms
        self.sigma = o.sigma
        self.distribution = o.distribution
        self.fail_on = o.fail_on
        self.stall_ms = o.stall_ms
        self.stall_after_batches = o.stall_after_batches
        self.error_rate = o.error_rate
        self.degrade_error_rate = o.degrade_error_rate
        self.degrade_extra_ms = o.degrade_extra_ms or 0.0
        self.degrade_after_s = o.degrade_after_s
        self.degrade_after_batches = o.degrade_after_batches
        self.degrades = o.degrades
        seed = o.seed
        self._batches = 0
        self._rng = random.Random(seed)
        self._fail_rng = random.Random(f"{seed}:errors")
        self._clock = clock
        self._loaded_at = clock()
        self._lock = threading.Lock()

    def load(self) -> None:
        """Starts the clock of ``degrade_after_s``."""
        self._loaded_at = self._clock()

    def degraded(self) -> bool:
        """Is the bad phase on (for the next batch)?"""
        with self._lock:
            return self._in_bad_phase(self._batches + 1)

    def _in_bad_phase(self, batch: int) -> bool:
        if not self.degrades:
            return False
        by_time = self.degrade_after_s is not None \
            and self._clock() - self._loaded_at >= self.degrade_after_s
        by_count = self.degrade_after_batches is not None and batch > self.degrade_after_batches
        untimed = self.degrade_after_s is None and self.degrade_after_batches is None
        return untimed or by_time or by_count

    def warmup(self) -> None:
        pass

    def describe(self) -> ModelMetadata:
        return ModelMetadata(platform="sokuji_synthetic",
                             inputs=(TensorSpec("text", "BYTES", (-1,)),),
                             outputs=(TensorSpec("length", "FP32", (-1, 1)),))

    def preprocess(self, texts: Sequence[str]) -> Prepared:
        lengths = [len(t) for t in texts]
        return Prepared(data=list(texts), num_items=len(texts), length=max(lengths, default=0),
                        num_tokens=sum(lengths))

    def service_time_ms(self, num_items: int) -> float:
        return self._draw(num_items)[0]

    def _draw(self, num_items: int) -> tuple[float, bool]:
        """The next batch's service time (ms) and whether it fails."""
        with self._lock:
            self._batches += 1
            stall = self.stall_ms if self._batches == self.stall_after_batches else 0.0
            bad = self._in_bad_phase(self._batches)
            rate = self.error_rate
            if bad:
                stall += self.degrade_extra_ms
                if self.degrade_error_rate is not None:
                    rate = self.degrade_error_rate
            fails = rate > 0.0 and self._fail_rng.random() < rate
            if self.distribution == "exponential":
                base = self._rng.expovariate(1.0 / self.base_ms) if self.base_ms else 0.0
            elif self.distribution == "lognormal":
                mu = math.log(self.base_ms) - self.sigma ** 2 / 2 if self.base_ms else 0.0
                base = self._rng.lognormvariate(mu, self.sigma) if self.base_ms else 0.0
            else:
                base = self.base_ms
        return base + self.per_item_ms * num_items + stall, fails

    def run_batch(self, batch: Sequence[Prepared]) -> list[np.ndarray]:
        texts = [t for p in batch for t in p.data]
        service_ms, fails = self._draw(len(texts))
        if service_ms > 0:
            time.sleep(service_ms / 1e3)
        if self.fail_on is not None and self.fail_on in texts:
            raise RuntimeFailed(f"synthetic failure on item {self.fail_on!r}")
        if fails:
            raise RuntimeFailed("synthetic failure (error rate)")
        return [np.asarray([[len(t)] for t in p.data], dtype=np.float32).reshape(-1, 1)
                for p in batch]

    def close(self) -> None:
        pass
