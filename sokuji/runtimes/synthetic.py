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

A failing batch (``fail_on``, ``error_rate``, ``degrade_error_rate``) raises ``RuntimeFailed``
after its service time, as a real runtime fails after computing.

Output: FP32 ``[n, 1]``, the length of each text in characters.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sokuji.errors import ConfigError, RuntimeFailed
from sokuji.runtimes.base import ModelMetadata, Prepared, TensorSpec

DISTRIBUTIONS = ("constant", "exponential", "lognormal")


class SyntheticRuntime:
    def __init__(self, options: Mapping[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        opts = dict(options or {})
        known = {"base_ms", "per_item_ms", "distribution", "sigma", "seed", "fail_on",
                 "stall_ms", "stall_after_batches", "error_rate", "degrade_after_s",
                 "degrade_after_batches", "degrade_error_rate", "degrade_extra_ms"}
        for key in opts:
            if key not in known:
                raise ConfigError.for_key(f"options.{key}", opts[key], "unknown option")
        self.base_ms = self._number(opts, "base_ms", 1.0)
        self.per_item_ms = self._number(opts, "per_item_ms", 0.0)
        self.sigma = self._number(opts, "sigma", 0.25)
        self.distribution = str(opts.get("distribution", "constant"))
        if self.distribution not in DISTRIBUTIONS:
            raise ConfigError.for_key("options.distribution", self.distribution,
                                      f"must be one of: {', '.join(DISTRIBUTIONS)}")
        self.fail_on = opts.get("fail_on")
        self.stall_ms = self._number(opts, "stall_ms", 0.0)
        self.stall_after_batches = int(self._number(opts, "stall_after_batches", 0))
        self.error_rate = self._fraction(opts, "error_rate", 0.0) or 0.0
        self.degrade_error_rate = self._fraction(opts, "degrade_error_rate", None)
        self.degrade_extra_ms = self._number(opts, "degrade_extra_ms", 0.0)
        self.degrade_after_s = (self._number(opts, "degrade_after_s", 0.0)
                                if "degrade_after_s" in opts else None)
        self.degrade_after_batches = self._whole(opts, "degrade_after_batches")
        self.degrades = self.degrade_error_rate is not None or "degrade_extra_ms" in opts
        if not self.degrades:
            for key in ("degrade_after_s", "degrade_after_batches"):
                if key in opts:
                    raise ConfigError.for_key(f"options.{key}", opts[key],
                                              "needs degrade_error_rate or degrade_extra_ms")
        seed = int(opts.get("seed", 0))
        self._batches = 0
        self._rng = random.Random(seed)
        self._fail_rng = random.Random(f"{seed}:errors")
        self._clock = clock
        self._loaded_at = clock()
        self._lock = threading.Lock()

    @staticmethod
    def _number(opts: Mapping[str, Any], key: str, default: float) -> float:
        value = opts.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError.for_key(f"options.{key}", value, "must be a number >= 0")
        return float(value)

    @staticmethod
    def _fraction(opts: Mapping[str, Any], key: str, default: float | None) -> float | None:
        value = opts.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0.0 <= value <= 1.0:
            raise ConfigError.for_key(f"options.{key}", value, "must be a number from 0 to 1")
        return float(value)

    @staticmethod
    def _whole(opts: Mapping[str, Any], key: str) -> int | None:
        value = opts.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
                or value != int(value):
            raise ConfigError.for_key(f"options.{key}", value, "must be a whole number >= 0")
        return int(value)

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
