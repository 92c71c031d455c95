"""Shadow (mirror) traffic: a copy of some of a router's requests goes to another target,
out of band: after the answer, at batch priority, only when that target admits it at once
(dropped and counted otherwise, never queued behind real work), never cached, never
answered to anyone, never counted against the target's breaker. Its answer is compared with
the one the client got: classifiers by label (argmax of every row), other encoders by
cosine (every row >= 0.99), generations by exact text. Outcomes and agreement go to
metrics (``sokuji_shadow_requests_total``, ``sokuji_shadow_disagreements_total``): how a new
version is judged on real traffic before it gets any of it."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sokuji.core.model import RequestContext
from sokuji.core.request import Priority
from sokuji.errors import SokujiError
from sokuji.routing.attempts import Target

OnShadow = Callable[[str, str, str, bool | None, float], None]
"""(router, target, outcome ok|error|dropped, agreed or None, seconds)."""


class Shadow:
    def __init__(self, router: str, target: Target, fraction: float, labels: bool,
                 rng: random.Random | None = None, on_result: OnShadow | None = None) -> None:
        self.router = router
        self.labels = labels
        """The answers are classifier scores: compared by label."""
        self.target = target
        self.fraction = fraction
        self.rng = rng or random.Random()
        self.on_result = on_result
        self.tasks: set[asyncio.Task[None]] = set()

    def maybe_copy(self, inputs: Any, answer: Any, ctx: RequestContext) -> None:
        if self.fraction < 1.0 and self.rng.random() >= self.fraction:
            return
        try:
            self.target.model.check_admission()
        except SokujiError:
            self._report("dropped", None, 0.0)
            return
        copy = RequestContext(tenant=ctx.tenant, priority=Priority.BATCH,
                              deadline_ns=ctx.deadline_ns, arrival_ns=time.perf_counter_ns(),
                              request_id=f"{ctx.request_id}-shadow" if ctx.request_id else "",
                              traceparent=ctx.traceparent)
        task = asyncio.get_running_loop().create_task(self._run(inputs, answer, copy))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, inputs: Any, answer: Any, ctx: RequestContext) -> None:
        t0 = time.perf_counter()
        model = self.target.model
        try:
            prepared = await model.prepare(inputs, ctx)
            handle = model.submit(prepared, ctx)
            out = await handle.result()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a shadow's failure is counted, never raised
            self._report("error", None, time.perf_counter() - t0)
            return
        self._report("ok", agree(answer, out, self.labels), time.perf_counter() - t0)

    def _report(self, outcome: str, agreed: bool | None, seconds: float) -> None:
        if self.on_result is not None:
            self.on_result(self.router, self.target.name, outcome, agreed, seconds)

    async def drain(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


def agree(answer: Any, other: Any, labels: bool) -> bool:
    """Classifier rows (``labels``): the same label; embeddings: cosine >= 0.99; text:
    equal."""
    if isinstance(answer, str) or isinstance(other, str):
        return bool(answer == other)
    a, b = np.asarray(answer, dtype=np.float32), np.asarray(other, dtype=np.float32)
    if a.shape != b.shape or a.ndim != 2:
        return False
    if labels:
        return bool(np.array_equal(a.argmax(axis=1), b.argmax(axis=1)))
    na = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cos = (a * b).sum(axis=1) / np.maximum(na, 1e-12)
    return bool(np.all(cos >= 0.99))
