"""The served model of kind ``echo`` (``sokuji/core/model.py``'s contract): one FP32 input
``x`` of any length in, ``y = x * scale`` out, over KServe V2 infer.

- ``from_tensors``: the decoded V2 request (its shape and datatype already checked against
  ``metadata`` by Sokuji's codec) as what ``prepare`` takes: the input's numpy array.
- ``limits``: its cost bound (``sokuji/core/limits.py``): the body's bytes and the elements
  of ``x``, the latter checked in ``from_tensors`` before anything is computed (413).
- ``prepare``: what only the model can judge (every element finite: ``InvalidInput``).
- ``submit``: admission (``max_queue_depth``, ``max_concurrency``: 429) and the deadline
  (504), then a handle whose ``result()`` waits ``delay_ms`` and answers.
- ``to_tensors``: the answer as the output ``y``. ``identity``: the input's bytes, so the
  response cache can answer a repeated request.
- The handle's report: a ``Server-Timing`` entry ``echo`` and a header ``x-echo-scale``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import numpy as np

from sokuji.config import ModelConfig
from sokuji.core.limits import Limit
from sokuji.core.model import (
    NOTHING,
    Api,
    Capacity,
    ModelBase,
    ModelMetadata,
    Report,
    RequestContext,
    TensorSpec,
)
from sokuji.core.policy import Admission, check_deadline
from sokuji.core.request import Stage
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.errors import InvalidInput

METADATA = ModelMetadata(platform="echo",
                         inputs=(TensorSpec("x", "FP32", (-1,)),),
                         outputs=(TensorSpec("y", "FP32", (-1,)),))


class EchoModel(ModelBase):
    apis = frozenset({Api.INFER})
    metadata = METADATA

    def __init__(self, config: ModelConfig, scale: float, delay_ms: float,
                 limits: tuple[Limit, ...] = ()) -> None:
        self.config = config
        self.limits = limits
        self.scale = np.float32(scale)
        self.delay_s = delay_ms / 1e3
        self.admission = Admission(config.name, config.max_queue_depth, config.max_concurrency)
        self.in_flight = 0
        self.started = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def alive(self) -> bool:
        return self.started

    @property
    def num_waiting(self) -> int:
        return self.in_flight

    def capacity(self) -> Capacity:
        return Capacity(ready=self.started, num_waiting=self.in_flight, num_running=0,
                        max_queue_depth=self.config.max_queue_depth, drain_per_s=0.0)

    def check_admission(self) -> None:
        self.admission.check(self.in_flight, self.in_flight, lambda: float(self.in_flight), 0.0)

    # -- Api.INFER ----------------------------------------------------------------------------
    def from_tensors(self, request: InferRequest) -> np.ndarray:
        x = request.inputs["x"].data
        for limit in self.limits:
            if limit.unit == "elements":
                limit.check(x.size, "input 'x'")
        return x

    def identity(self, inputs: np.ndarray) -> list[str]:
        return [hashlib.sha256(inputs.tobytes()).hexdigest()]

    async def prepare(self, inputs: np.ndarray, ctx: RequestContext) -> np.ndarray:
        if not np.isfinite(inputs).all():
            raise InvalidInput("input 'x' must be finite (no NaN or infinity)", param="inputs.x")
        return inputs

    def submit(self, prepared: np.ndarray, ctx: RequestContext) -> EchoSubmission:
        self.check_admission()
        check_deadline(ctx.deadline_ns, time.perf_counter_ns(), 0.0, 0.0, saturated=False)
        self.in_flight += 1
        return EchoSubmission(self, prepared, ctx)

    def to_tensors(self, result: np.ndarray, report: Report) -> list[Tensor]:
        return [Tensor("y", "FP32", result.shape, result)]

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    def close(self) -> None:
        pass


class EchoSubmission:
    """One request's handle: ``result()`` is ``x * scale``, ``delay_ms`` after it was asked."""

    def __init__(self, model: EchoModel, x: np.ndarray, ctx: RequestContext) -> None:
        self.model = model
        self.x = x
        self.ctx = ctx
        self.report: Report = NOTHING
        self.open = True

    async def result(self) -> np.ndarray:
        t0 = time.perf_counter_ns()
        try:
            if self.model.delay_s:
                await asyncio.sleep(self.model.delay_s)
            y = self.x * self.model.scale
        finally:
            self.cancel()
        if self.ctx.timeline is not None:  # the wait and the product are its `infer` stage
            self.ctx.timeline.mark(Stage.INFER)
        scale = f"{self.model.scale:g}"
        self.report = Report(timing=(("echo", (time.perf_counter_ns() - t0) / 1e6,
                                      f"scale {scale}"),),
                             headers={"x-echo-scale": scale})
        return y

    def events(self) -> Any:
        raise NotImplementedError("an echo model answers whole results")

    def cancel(self) -> None:
        if self.open:
            self.open = False
            self.model.in_flight -= 1
