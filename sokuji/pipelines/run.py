"""One request through a pipeline: each step started as soon as the steps it reads have
finished, each one timed, bounded and failing by name.

Every step is an asyncio task created at once; a task first awaits the tasks of the steps it
depends on (already finished ones cost nothing), so independent steps overlap on the event
loop and in the threads and models they call. A step's time is bounded by its
``timeout_ms`` and by the request's deadline (what is left of it when the step starts; a
step that would start past the deadline fails with 504 at once). A failure ends the request
with ``StepFailed`` naming the step, unless the step has a fallback value, which then
becomes its output (outcome ``fallback``, counted in metrics). When the answer fails the
other steps still running are cancelled.

Timing: each step's start and end (``perf_counter_ns``) from which ``timing_entries`` gives
``step.<name>`` entries (duration; start offset in the description) and ``critical-path``:
the chain of steps, each the last to finish among those the next waited for, that set the
answer's time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sokuji.core import timing
from sokuji.core.model import GenerationInput, RequestContext
from sokuji.errors import DeadlineExceeded, SokujiError, StepFailed
from sokuji.pipelines.graph import Graph, Node

MISSING = object()


@dataclass(slots=True)
class StepTime:
    start_ns: int = 0
    end_ns: int = 0
    outcome: str = ""
    """ok | fallback | failed | timeout | cancelled ('' : never started)"""


@dataclass(frozen=True, slots=True)
class Answer:
    """A chat request whose answer step's events the caller relays: that step (a generator)
    samples as ``request`` asks, records into ``timing`` (the pipeline's, arrival at the
    pipeline's), and returns its handle, not its text."""

    request: GenerationInput
    timing: Any


StepFn = Callable[[dict[str, Any], RequestContext, Answer | None], Any]
"""A step's work: (arguments, context, the answer's request when this step is the streamed
answer, else None) -> awaitable."""


class Run:
    """One request's pass through ``graph``: ``steps[i]`` does node ``i``'s work."""

    __slots__ = ("answer", "ctx", "graph", "inputs", "outputs", "start_ns", "steps",
                 "tasks", "times")

    def __init__(self, graph: Graph, steps: list[StepFn], inputs: dict[str, Any],
                 ctx: RequestContext, answer: Answer | None = None) -> None:
        self.graph = graph
        self.steps = steps
        self.inputs = inputs
        self.ctx = ctx
        self.answer = answer
        self.times = [StepTime() for _ in graph.nodes]
        self.outputs: list[Any] = [MISSING] * len(graph.nodes)
        self.tasks: list[asyncio.Task[Any]] = []
        self.start_ns = 0

    def start(self) -> asyncio.Task[Any]:
        """Start every step; the returned task ends with the answer's output (or its
        error). Call on the event loop."""
        self.start_ns = time.perf_counter_ns()
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._step(node)) for node in self.graph.nodes]
        for task in self.tasks:  # a failure is read by whoever awaits it; none is "lost"
            task.add_done_callback(_quiet)
        answer = loop.create_task(self._answer())
        answer.add_done_callback(_quiet)  # (awaiting it still raises)
        return answer

    async def _answer(self) -> Any:
        try:
            out = await self.tasks[self.graph.output]
            for i in self.graph.extra:
                await self.tasks[i]
            return out
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    def extra(self) -> dict[str, Any]:
        """The extra outputs, by step name (after the answer)."""
        return {self.graph.nodes[i].name: self.outputs[i] for i in self.graph.extra}

    async def _step(self, node: Node) -> Any:
        for dep in node.deps:
            await self.tasks[dep]  # raises a dependency's failure: this step never starts
        args = {}
        for arg, ref in node.args:
            if ref.step is None:
                args[arg] = self.inputs.get(ref.key) if ref.key is not None else None
                continue
            value = self.outputs[ref.step]
            if ref.key is not None:
                if not isinstance(value, dict) or ref.key not in value:
                    raise StepFailed(self.graph.name, node.name, SokujiError(
                        f"input '{arg}' reads '{self.graph.nodes[ref.step].name}."
                        f"{ref.key}', which that step's output does not have"))
                value = value[ref.key]
            args[arg] = value
        t = self.times[node.index]
        t.start_ns = time.perf_counter_ns()
        cfg = node.config
        try:
            budget_s = cfg.timeout_ms / 1000 if cfg.timeout_ms else None
            if self.ctx.deadline_ns is not None:
                left_s = (self.ctx.deadline_ns - t.start_ns) / 1e9
                if left_s <= 0:
                    raise DeadlineExceeded("the request's deadline passed before this step "
                                           "could start")
                budget_s = left_s if budget_s is None else min(budget_s, left_s)
            work = self.steps[node.index](
                args, self.ctx, self.answer if node.index == self.graph.output else None)
            if budget_s is None:
                value = await work
            else:
                try:
                    async with asyncio.timeout(budget_s):
                        value = await work
                except TimeoutError:
                    t.outcome = "timeout"
                    why = ("its timeout_ms" if cfg.timeout_ms
                           and budget_s >= cfg.timeout_ms / 1000 else "the request's deadline")
                    raise DeadlineExceeded(f"took longer than {budget_s * 1000:.0f} ms "
                                           f"({why})") from None
            t.outcome = "ok"
        except asyncio.CancelledError:
            t.outcome = t.outcome or "cancelled"
            t.end_ns = time.perf_counter_ns()
            raise
        except Exception as exc:  # any failure of a step: named, or its fallback
            t.end_ns = time.perf_counter_ns()
            if cfg.on_error == "fallback":
                t.outcome = "fallback"
                self.outputs[node.index] = cfg.fallback
                return cfg.fallback
            t.outcome = t.outcome or "failed"
            raise StepFailed(self.graph.name, node.name, exc) from exc
        t.end_ns = time.perf_counter_ns()
        self.outputs[node.index] = value
        return value

    # -- timing ------------------------------------------------------------------------------
    def critical_path(self) -> list[int]:
        """From the answer back: at each step, the dependency that finished last."""
        path = [self.graph.output]
        node = self.graph.nodes[self.graph.output]
        while node.deps:
            last = max(node.deps, key=lambda d: self.times[d].end_ns)
            path.append(last)
            node = self.graph.nodes[last]
        return path[::-1]

    def timing_entries(self, end_ns: int | None = None) -> list[timing.Entry]:
        """``step.<name>`` (duration; start offset and outcome) for every step that ran, in
        the graph's order, then the critical path. ``end_ns``: when the answer's step is
        still running (a stream), its end so far."""
        ms = 1e-6
        out: list[timing.Entry] = []
        for node, t in zip(self.graph.nodes, self.times, strict=True):
            if not t.start_ns:
                continue
            end = t.end_ns or end_ns or time.perf_counter_ns()
            desc = f"start={(t.start_ns - self.start_ns) * ms:.3f}"
            if t.outcome not in ("ok", ""):
                desc += f" {t.outcome}"
            out.append((f"step.{node.name}", (end - t.start_ns) * ms, desc))
        path = [i for i in self.critical_path() if self.times[i].start_ns]
        if path:
            first, last = self.times[path[0]], self.times[path[-1]]
            end = last.end_ns or end_ns or time.perf_counter_ns()
            out.append(("critical-path", (end - first.start_ns) * ms,
                        ">".join(self.graph.nodes[i].name for i in path)))
        return out

    def steps_header(self) -> str:
        """Each finished step as ``name;start=ms;dur=ms``: the overlap of parallel steps,
        for a response header (sent before a stream begins)."""
        ms = 1e-6
        return ", ".join(
            f"{n.name};start={(t.start_ns - self.start_ns) * ms:.3f};"
            f"dur={(t.end_ns - t.start_ns) * ms:.3f}"
            for n, t in zip(self.graph.nodes, self.times, strict=True)
            if t.start_ns and t.end_ns)


def _quiet(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: asyncio does not log it as never read
