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

Output: FP32 ``[n, 1]``, the length of each text in characters.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sokuji.errors import ConfigError, RuntimeFailed
from sokuji.runtimes.base import ModelMetadata, Prepared, TensorSpec

DISTRIBUTIONS = ("constant", "exponential", "lognormal")


class SyntheticRuntime:
    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        opts = dict(options or {})
        known = {"base_ms", "per_item_ms", "distribution", "sigma", "seed", "fail_on",
                 "stall_ms", "stall_after_batches"}
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
        self._batches = 0
        self._rng = random.Random(int(opts.get("seed", 0)))
        self._lock = threading.Lock()

    @staticmethod
    def _number(opts: Mapping[str, Any], key: str, default: float) -> float:
        value = opts.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError.for_key(f"options.{key}", value, "must be a number >= 0")
        return float(value)

    def load(self) -> None:
        pass

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
        with self._lock:
            self._batches += 1
            stall = self.stall_ms if self._batches == self.stall_after_batches else 0.0
            if self.distribution == "exponential":
                base = self._rng.expovariate(1.0 / self.base_ms) if self.base_ms else 0.0
            elif self.distribution == "lognormal":
                mu = math.log(self.base_ms) - self.sigma ** 2 / 2 if self.base_ms else 0.0
                base = self._rng.lognormvariate(mu, self.sigma) if self.base_ms else 0.0
            else:
                base = self.base_ms
        return base + self.per_item_ms * num_items + stall

    def run_batch(self, batch: Sequence[Prepared]) -> list[np.ndarray]:
        texts = [t for p in batch for t in p.data]
        service_ms = self.service_time_ms(len(texts))
        if service_ms > 0:
            time.sleep(service_ms / 1e3)
        if self.fail_on is not None and self.fail_on in texts:
            raise RuntimeFailed(f"synthetic failure on item {self.fail_on!r}")
        return [np.asarray([[len(t)] for t in p.data], dtype=np.float32).reshape(-1, 1)
                for p in batch]

    def close(self) -> None:
        pass
