"""A pipeline served under the model contract (``core/model.py``): addressed like a model,
admitted like one, its steps run by ``run.py``.

- ``check_admission`` (the edge, before the body): the pipeline's own bound on requests in
  flight (``max_concurrency``) and the admission of every model its steps call (a full LLM
  queue refuses the request before any step runs: 429 at once, not after retrieval).
  ``submit`` admits against its own bound only: each step's model admits its own request
  when the step submits it.
- ``prepare(inputs, ctx)``: the request's inputs (a mapping; from V2, ``from_tensors``: its
  JSON tensors by name, one element as itself, several as a list) checked against the
  declared ones: required present, unknown refused, strings / lists of strings / a chat's
  messages. A chat request (a ``GenerationInput``, when the answer generates: ``Api.GENERATE``)
  becomes the inputs ``chat_inputs`` says, its answer sampled as it asks, within the answer
  step's ``max_tokens``: that is a ceiling, and a chat asking for more is a 400 naming it
  (before any step runs; what OpenAI and vLLM answer a ``max_tokens`` over a model's limit).
  Asking for none gives the step's.
- ``submit(prepared, ctx)``: starts every step (``Run``); the handle's ``result()`` is the
  answer step's output (a generator's whole text), its report the extra outputs, the steps'
  ``Server-Timing`` entries and ``x-sokuji-pipeline-steps``. A chat's handle is an
  ``EventStream`` (``core/events.py``) with a ``timing``, as a ``GenerationRequest`` is: the
  OpenAI endpoints stream it unchanged. Its ``timing`` is the answer's generation timing,
  arrival at the pipeline's arrival, with the steps' entries in front.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from sokuji.core import timing
from sokuji.core.events import Event, EventStream, Finish
from sokuji.core.limits import Limit
from sokuji.core.model import (
    Api,
    Capacity,
    GenerationInput,
    ModelBase,
    ModelMetadata,
    Report,
    RequestContext,
    ServedModel,
    TensorSpec,
)
from sokuji.core.request import Stage, Timeline
from sokuji.core.tensor import BYTES, InferRequest, Tensor
from sokuji.errors import BadRequest, InvalidInput, Overloaded, SokujiError
from sokuji.llm.request import Timing
from sokuji.pipelines.config import PipelineConfig
from sokuji.pipelines.graph import Graph
from sokuji.pipelines.run import Answer, Run, StepFn
from sokuji.pipelines.step_options import step_options
from sokuji.pipelines.steps import Resources, build_step

MAX_INPUT_CHARS = 64 * 1024
"""The most characters one string input may have (the steps' own limits apply too)."""
MAX_ELEMENTS = 1024
"""The most elements one V2 input may have."""
CHARS = Limit("characters", MAX_INPUT_CHARS, "characters",
              "characters of one input (a list's summed); each step's model bounds its own")
ELEMENTS = Limit("elements", MAX_ELEMENTS, "elements", "elements of one V2 input")
STEPS_HEADER = "x-sokuji-pipeline-steps"


@dataclass(frozen=True)
class PreparedPipeline:
    inputs: dict[str, Any]
    answer: GenerationInput | None = None
    """A chat request: the answer's events are relayed, sampled as it asks."""


class PipelineModel(ModelBase):

    def __init__(self, graph: Graph, res: Resources, at: str) -> None:
        self.graph = graph
        self.config: PipelineConfig = graph.config
        answer = graph.nodes[graph.output].config
        self.generates = answer.kind == "model" and \
            Api.GENERATE in res.models[answer.model].apis
        """Its answer is generated text: also served on the OpenAI endpoints, streamed."""
        self.apis = frozenset({Api.INFER, Api.GENERATE}) if self.generates \
            else frozenset({Api.INFER})
        self.max_tokens: int | None = step_options(
            answer, f"{at}.steps[{graph.output}]").max_tokens if self.generates else None
        """The answer step's ``max_tokens``: the most a chat may ask for (None: the model's)."""
        self.owned: dict[int, ServedModel] = {}
        """The ``python`` steps' own models (``python_step.py``), by node: started, stopped
        and closed with the pipeline."""
        try:
            for n in graph.nodes:
                if n.config.kind == "python":
                    assert res.build_python is not None
                    self.owned[n.index] = res.build_python(
                        self.config.name, n.config, f"{at}.steps[{n.index}]",
                        self.config.max_concurrency)
            self.steps: list[StepFn] = [
                build_step(n.config, f"{at}.steps[{n.index}]", res, self.owned.get(n.index))
                for n in graph.nodes]
        except BaseException:
            self.close()
            raise
        self.callees = [res.models[n.config.model] for n in graph.nodes
                        if n.config.kind == "model"]
        self.callees += self.owned.values()
        for n in graph.nodes:
            enc = n.config.options.get("encoder") if n.config.kind == "retrieve" else None
            if enc:
                self.callees.append(res.models[enc])
        self.in_flight = 0
        self.started = False
        self.on_done: Callable[[Run], None] | None = None
        """Called (soon, on the loop) with each request's run once its steps are done:
        the metrics."""
        self.limits = (ELEMENTS, CHARS, Limit(
            "steps", len(graph.nodes), "steps", "steps one request runs (each at most once)"))
        """Its cost bound: what one input may hold, and its steps; each step's model states
        and checks its own (a generation's tokens, an encoder's texts)."""
        outputs = [TensorSpec(graph.nodes[graph.output].name, "BYTES", (-1,))]
        outputs += [TensorSpec(graph.nodes[i].name, "BYTES", (-1,)) for i in graph.extra]
        self.metadata = ModelMetadata(
            "sokuji_pipeline",
            (*(TensorSpec(name, BYTES, (-1,)) for name in self.config.inputs),
             *(TensorSpec(name, BYTES, (-1,), optional=True)
               for name in self.config.optional_inputs if name not in self.config.inputs)),
            tuple(outputs))

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def alive(self) -> bool:
        return self.started and all(m.alive for m in self.callees)

    @property
    def num_waiting(self) -> int:
        return 0  # a pipeline queues nothing itself: its steps' models do

    def capacity(self) -> Capacity:
        return Capacity(ready=self.alive, num_waiting=0, num_running=self.in_flight,
                        max_queue_depth=self.config.max_concurrency, drain_per_s=0.0)

    def attach(self, observers: Any) -> None:
        self.on_done = observers.pipeline_done()  # step times (and spans, when traced)

    def check_admission(self) -> None:
        self._admit()
        for model in self.callees:
            model.check_admission()

    def _admit(self) -> None:
        limit = self.config.max_concurrency
        if limit and self.in_flight >= limit:
            raise Overloaded(f"pipeline '{self.name}': {self.in_flight} requests in flight "
                             f"(max_concurrency {limit})", retry_after_s=1)

    # -- V2 -------------------------------------------------------------------------------
    def from_tensors(self, request: InferRequest) -> dict[str, Any]:
        """Its JSON tensors by name: one element as itself, several as a list."""
        out: dict[str, Any] = {}
        for name, tensor in request.inputs.items():
            if tensor.binary:
                raise BadRequest("pipelines take JSON tensors only, not the binary extension")
            data = tensor.data if tensor.datatype == BYTES else tensor.data.reshape(-1).tolist()
            ELEMENTS.check(len(data), f"input '{name}'")
            out[name] = data[0] if len(data) == 1 else data
        return out

    def identity(self, inputs: Any) -> Sequence[str] | None:
        if not isinstance(inputs, Mapping):
            return None  # a chat: generated, never cached
        return [orjson.dumps(inputs, option=orjson.OPT_SORT_KEYS).decode()]

    def to_tensors(self, result: Any, report: Report) -> list[Tensor]:
        """The answer, then each extra output, named by their steps."""
        answer = self.graph.nodes[self.graph.output].name
        return [_tensor(answer, result),
                *(_tensor(name, value) for name, value in report.outputs.items())]

    async def prepare(self, inputs: Any, ctx: RequestContext) -> PreparedPipeline:
        if isinstance(inputs, GenerationInput):  # a chat: the answer is relayed
            ceiling, asked = self.max_tokens, inputs.max_tokens
            if ceiling is not None and asked is not None and asked > ceiling:
                raise InvalidInput(f"{inputs.max_tokens_field} {asked} exceeds pipeline "
                                   f"'{self.name}''s limit of {ceiling} tokens (its answer "
                                   "step's max_tokens)", param=inputs.max_tokens_field)
            chat = self.chat_inputs(inputs, getattr(inputs, "user", None))
            return dataclasses.replace(await self.prepare(chat, ctx), answer=inputs)
        cfg = self.config
        for name in cfg.inputs:
            if inputs.get(name) is None:
                raise InvalidInput(f"pipeline '{self.name}' needs input '{name}'", param=name)
        for name, value in inputs.items():
            if name not in cfg.inputs and name not in cfg.optional_inputs:
                known = ", ".join((*cfg.inputs, *cfg.optional_inputs))
                raise InvalidInput(f"pipeline '{self.name}' has no input '{name}' "
                                   f"(inputs: {known})", param=name)
            _check_value(name, value)
        return PreparedPipeline(inputs)

    def submit(self, prepared: PreparedPipeline, ctx: RequestContext) -> Any:
        """A ``PipelineSubmission``; for a chat, the answer's tokens as a generation's events
        (``PipelineGeneration``, ``generates`` only), sampled as the chat request asks."""
        self._admit()
        timeline = ctx.timeline
        if timeline is not None:  # the steps' models stamp their own; this is the request's
            ctx = dataclasses.replace(ctx, timeline=None)
        if prepared.answer is None:
            run = Run(self.graph, self.steps, prepared.inputs, ctx)
            return PipelineSubmission(self, run, run.start(), timeline)
        timing_ = PipelineTiming(arrival_ns=ctx.arrival_ns)
        run = Run(self.graph, self.steps, prepared.inputs, ctx,
                  answer=Answer(prepared.answer, timing_))
        timing_.run = run
        return PipelineGeneration(self, run, timing_)

    def chat_inputs(self, req: GenerationInput, user: str | None) -> dict[str, Any]:
        """A chat request as the pipeline's inputs: the last user message, the messages,
        the ``user`` field."""
        if not req.chat or not req.messages:
            raise InvalidInput(f"pipeline '{self.name}' answers chats: use "
                               "/v1/chat/completions", param="model")
        last = next((m.get("content") for m in reversed(req.messages)
                     if m.get("role") == "user"), None)
        if not isinstance(last, str) or not last.strip():
            raise InvalidInput("the conversation needs a user message with text",
                               param="messages")
        inputs: dict[str, Any] = {self.config.chat_input: last}
        if "messages" in self.config.optional_inputs:
            inputs["messages"] = req.messages
        if user is not None and "user" in (*self.config.inputs, *self.config.optional_inputs):
            inputs["user"] = user
        return inputs

    def start(self) -> None:
        for model in self.owned.values():
            model.start()
        self.started = True

    async def stop(self) -> None:
        self.started = False
        await asyncio.gather(*(m.stop() for m in self.owned.values()))

    def close(self) -> None:
        for model in self.owned.values():
            model.close()


def _check_value(name: str, value: Any) -> None:
    if isinstance(value, str):
        CHARS.check(len(value), f"input '{name}'")
        return
    if isinstance(value, list) and all(isinstance(v, str | dict) for v in value):
        CHARS.check(sum(len(v) if isinstance(v, str) else len(str(v)) for v in value),
                    f"input '{name}'")
        return
    if isinstance(value, dict | int | float | bool):
        return
    raise InvalidInput(f"input '{name}' must be a string or a list of strings", param=name)


class PipelineSubmission:
    """The handle of a pipeline request (``Submission``)."""

    def __init__(self, model: PipelineModel, run: Run, task: asyncio.Task[Any],
                 timeline: Timeline | None = None) -> None:
        self.model = model
        self.run = run
        self.task = task
        self.timeline = timeline
        model.in_flight += 1
        task.add_done_callback(self._done)

    def _done(self, _: Any) -> None:
        self.model.in_flight -= 1
        if self.model.on_done is not None:
            asyncio.get_running_loop().call_soon(self.model.on_done, self.run)

    async def result(self) -> Any:
        """The answer step's output; the request's Timeline ``infer`` spans the run."""
        out = await self.task
        if self.timeline is not None:
            self.timeline.mark(Stage.INFER)
        return out

    @property
    def report(self) -> Report:
        """The extra outputs, the steps' timing entries and their starts and durations."""
        run = self.run
        return Report(timing=tuple(run.timing_entries()),
                      headers={STEPS_HEADER: run.steps_header()}, outputs=run.extra())

    async def events(self) -> AsyncIterator[Any]:
        yield await self.task

    def cancel(self) -> None:
        self.run.cancel()
        self.task.cancel()


class PipelineGeneration(EventStream):
    """A pipeline whose answer is generated, as the OpenAI endpoints see a generation:
    ``next_events()`` waits for the steps before the answer, then relays the answer's
    ``Delta``s and ``Finish``; a failed step becomes a ``Finish`` carrying its error."""

    def __init__(self, model: PipelineModel, run: Run, timing_: PipelineTiming) -> None:
        self.model = model
        self.run = run
        self.timing = timing_
        self.gen: Any = None
        self.extra: dict[str, Any] = {}
        self.cancelled = False
        model.in_flight += 1
        self._open = True
        self.task = run.start()

    @property
    def report(self) -> Report:
        """The steps so far (when each ran) and the extra outputs (its ``sources``)."""
        return Report(headers={STEPS_HEADER: self.run.steps_header()}, outputs=self.extra)

    async def next_events(self) -> list[Event]:
        if self.gen is None:
            try:
                self.gen = await self.task
                self.extra = self.run.extra()
            except asyncio.CancelledError:
                self._close()
                return [Finish("cancelled", 0)]
            except SokujiError as exc:
                self._close()
                self.timing.end_ns = time.perf_counter_ns()
                return [Finish("error", 0, exc)]
            if self.cancelled:
                self.gen.cancel()
        events = await self.gen.next_events()
        if isinstance(events[-1], Finish):
            self.run.times[self.model.graph.output].end_ns = self.timing.end_ns or \
                time.perf_counter_ns()
            self._close()
        return events

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.model.in_flight -= 1
            if self.model.on_done is not None:
                asyncio.get_running_loop().call_soon(self.model.on_done, self.run)

    def cancel(self) -> None:
        """The caller went away (or is done): stop what runs; no longer in flight."""
        self.cancelled = True
        if self.gen is not None:
            self.gen.cancel()
        else:
            self.run.cancel()
            self.task.cancel()
        self._close()


def _tensor(name: str, value: Any) -> Tensor:
    """An output as a tensor: a vector or matrix as FP32, a string a BYTES element, a list
    of strings one element each, anything else (a retrieval's hits, a feature row) JSON text
    per element."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiu":
        return Tensor(name, "FP32", value.shape, value.astype(np.float32, copy=False))
    if isinstance(value, str):
        return Tensor(name, BYTES, (1,), [value])
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return Tensor(name, BYTES, (len(value),), value)
    items = value if isinstance(value, list) else [value]
    return Tensor(name, BYTES, (len(items),), [
        orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY).decode() for v in items])


class PipelineTiming(Timing):
    """A generation's timing with the pipeline's steps in front."""

    run: Run

    def timing_entries(self) -> list[timing.Entry]:
        return [*self.run.timing_entries(self.end_ns or None), *super().timing_entries()]
