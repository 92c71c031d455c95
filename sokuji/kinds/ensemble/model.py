"""``EnsembleModel``: a Triton ensemble's steps run in order, each step's model called through
the model contract (``from_tensors``, ``prepare``, ``submit``, ``to_tensors``: its own
admission, queue, batching and limits, under the request's context), tensors carried between
the steps by the names the ensemble's ``input_map`` / ``output_map`` give them.

What it does not do (Triton's ensemble scheduler does): run independent steps at the same
time (they run one after the other, in the configuration's order, which must already be an
order where each step's inputs are made before it), or call a version other than the one
each model serves by default. Its own queue is its steps' models' queues: it holds nothing
itself; an ensemble's answer is never cached (its steps' answers may be).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from sokuji.core.limits import Limit
from sokuji.core.model import (
    Api,
    Capacity,
    ModelBase,
    ModelMetadata,
    Report,
    RequestContext,
    ServedModel,
    TensorSpec,
)
from sokuji.core.request import Stage
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.errors import ConfigError, InvalidInput

INFER = frozenset({Api.INFER})
NOTHING = Report()


class EnsembleModel(ModelBase):
    def __init__(self, config: Any, options: Any, steps: list[tuple[Any, ServedModel]],
                 at: str) -> None:
        self.config = config
        self.options = options
        self.steps = steps
        self.apis = INFER
        self.started = False
        self.in_flight = 0
        self.triton_config: dict[str, Any] | None = dict(options.triton_config) or None
        self.limits = (Limit("steps", len(steps), "steps",
                             "steps one request runs, in order; each step's model states "
                             "and checks its own limits"),)
        lead = (-1,) if config.max_batch_size else ()
        self.metadata = ModelMetadata(
            "ensemble",
            tuple(TensorSpec(d.name, d.datatype, lead + tuple(d.dims), optional=d.optional)
                  for d in options.inputs),
            tuple(TensorSpec(d.name, d.datatype, lead + tuple(d.dims))
                  for d in options.outputs))
        self._check_flow(at)

    def _check_flow(self, at: str) -> None:
        """Every tensor a step reads is made before it, with the datatype it expects; every
        output of the ensemble is made by a step (``ConfigError`` naming the step)."""
        made = {t.name: t.datatype for t in self.metadata.inputs}
        for i, (step, served) in enumerate(self.steps):
            where = f"{at} ({self.config.name}).options.steps[{i}] ({step.model})"
            ins = {t.name: t for t in served.metadata.inputs}
            outs = {t.name: t for t in served.metadata.outputs}
            for model_in, tensor in step.input_map.items():
                spec = ins.get(model_in)
                if spec is None:
                    raise ConfigError(f"{where}: input_map names input '{model_in}', which "
                                      f"the model has not (it has {', '.join(ins)})")
                if tensor not in made:
                    raise ConfigError(f"{where}: input '{model_in}' reads '{tensor}', which "
                                      "no earlier step (nor the ensemble's inputs) makes")
                if made[tensor] != spec.datatype:
                    raise ConfigError(f"{where}: '{tensor}' is {made[tensor]}; the model's "
                                      f"input '{model_in}' is {spec.datatype}")
            missing = [n for n, s in ins.items() if not s.optional and n not in step.input_map]
            if missing:
                raise ConfigError(f"{where}: the model's input(s) {', '.join(missing)} are "
                                  "not in input_map")
            for model_out, tensor in step.output_map.items():
                if model_out not in outs:
                    raise ConfigError(f"{where}: output_map names output '{model_out}', "
                                      f"which the model has not (it has {', '.join(outs)})")
                made[tensor] = outs[model_out].datatype
        for t in self.metadata.outputs:
            if t.name not in made:
                raise ConfigError(f"{at} ({self.config.name}): output '{t.name}' is made by "
                                  "no step's output_map")

    @property
    def name(self) -> str:
        return str(self.config.name)

    @property
    def alive(self) -> bool:
        return self.started and all(served.alive for _, served in self.steps)

    @property
    def num_waiting(self) -> int:
        return 0  # its steps' models queue

    def capacity(self) -> Capacity:
        return Capacity(ready=self.alive, num_waiting=0, num_running=self.in_flight,
                        max_queue_depth=self.config.max_queue_depth, drain_per_s=0.0)

    def check_admission(self) -> None:
        for _, served in self.steps:
            served.check_admission()

    def from_tensors(self, request: InferRequest) -> dict[str, Tensor]:
        return dict(request.inputs)

    async def prepare(self, inputs: dict[str, Tensor], ctx: RequestContext) -> Any:
        return inputs

    def submit(self, prepared: dict[str, Tensor], ctx: RequestContext) -> EnsembleSubmission:
        timeline = ctx.timeline
        if timeline is not None:  # the steps' models stamp their own
            ctx = dataclasses.replace(ctx, timeline=None)
        return EnsembleSubmission(self, asyncio.ensure_future(self._run(prepared, ctx)),
                                  timeline)

    async def _run(self, inputs: dict[str, Tensor], ctx: RequestContext) -> list[Tensor]:
        tensors = dict(inputs)
        for step, served in self.steps:
            feed = {model_in: _renamed(tensors[name], model_in)
                    for model_in, name in step.input_map.items()}
            _check_shapes(step.model, served, feed)
            request = served.from_tensors(InferRequest(inputs=feed))
            sub = served.submit(await served.prepare(request, ctx), ctx)
            result = await sub.result()
            made = {t.name: t for t in served.to_tensors(result, sub.report)}
            for model_out, name in step.output_map.items():
                tensors[name] = _renamed(made[model_out], name)
        return [tensors[t.name] for t in self.metadata.outputs]

    def to_tensors(self, result: list[Tensor], report: Report) -> list[Tensor]:
        return result

    def identity(self, inputs: Any) -> Sequence[str] | None:
        return None

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    def close(self) -> None:
        pass


def _renamed(t: Tensor, name: str) -> Tensor:
    return Tensor(name, t.datatype, tuple(t.shape), t.data)


def _check_shapes(model: str, served: ServedModel, feed: dict[str, Tensor]) -> None:
    """A step's inputs against its model's shapes (the codec checks only the ensemble's own):
    a mismatch is the ensemble's, named with the step."""
    specs = {t.name: t for t in served.metadata.inputs}
    for name, t in feed.items():
        want = specs[name].shape
        shape = tuple(t.shape)
        if len(shape) == len(want) + 1 and shape[-1] == 1:
            shape = shape[:-1]
        if len(shape) != len(want) or any(w not in (-1, s) for w, s in zip(want, shape,
                                                                            strict=True)):
            raise InvalidInput(f"ensemble step '{model}': input '{name}' would get shape "
                               f"{list(t.shape)}; the model takes {list(want)}",
                               param=f"inputs.{name}.shape")


class EnsembleSubmission:
    """The handle of one ensemble request (``Submission``)."""

    def __init__(self, model: EnsembleModel, task: asyncio.Future[list[Tensor]],
                 timeline: Any) -> None:
        self.model = model
        self.task = task
        self.timeline = timeline
        model.in_flight += 1
        task.add_done_callback(self._done)

    def _done(self, _: Any) -> None:
        self.model.in_flight -= 1

    async def result(self) -> list[Tensor]:
        out = await self.task
        if self.timeline is not None:
            self.timeline.mark(Stage.INFER)
        return out

    async def events(self) -> AsyncIterator[Any]:
        yield await self.task

    def cancel(self) -> None:
        self.task.cancel()

    @property
    def report(self) -> Report:
        return NOTHING
