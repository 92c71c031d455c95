"""A routed request's handle: what ``RouterModel.submit`` returns.

- ``RouteSubmission`` (encoders, classifiers): ``result()`` runs the attempts; for a
  cascade, the small classifier answers every item and the items whose margin is below the
  threshold go to the large one, whose rows replace the small one's (if the large one cannot
  answer, the small one's answer stands: a cascade degrades to its small model, never to an
  error).
- ``RouteGeneration`` (generators): quacks like ``llm/request.GenerationRequest`` for the
  OpenAI endpoints. It tries targets until one produces its first event; that is the commit
  point: before it, a failure moves on to the next target unseen by the client; after it,
  the chosen target's stream is relayed as it is (a failure ends it with an error event). A
  generation cascade's commit point is later: the small generator's whole answer, whose mean
  token log-probability decides whether it stands or the large one answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

import numpy as np

from sokuji.core.events import Delta, EventStream, Finish
from sokuji.core.model import Report, RequestContext
from sokuji.errors import SokujiError
from sokuji.llm.request import Timing
from sokuji.routing.attempts import Attempts, PreparedRoute, RouteInfo, Target
from sokuji.routing.config import RouterOptions


class Router(Protocol):
    """What a handle needs of the router that made it (``router.RouterModel``)."""

    in_flight: int
    """Requests admitted and not finished: a handle counts itself in, then out once."""
    options: RouterOptions
    targets: dict[str, Target]
    threshold: float | None
    shadow: Any

    def attempts(self, ctx: RequestContext) -> Attempts: ...

    def plan(self, prepared: PreparedRoute, ctx: RequestContext
             ) -> list[tuple[Target, str]]: ...

    def routed(self, info: RouteInfo) -> None: ...


class RouteSubmission:
    def __init__(self, router: Router, prepared: PreparedRoute, ctx: RequestContext):
        self.router = router
        self.prepared = prepared
        self.ctx = ctx
        router.in_flight += 1
        self._open = True

    async def result(self) -> Any:
        """Runs the attempts in the caller's task: a caller that is cancelled (its client
        went away) cancels the attempt in flight with it."""
        try:
            return await self._run()
        finally:
            self._close()

    def cancel(self) -> None:
        self._close()

    @property
    def report(self) -> Report:
        """The target that answered, why and what was tried (the ``route`` timing entry)."""
        info = self.prepared.route
        return Report(served_by=info.served_by, timing=(info.timing_entry(),),
                      input_tokens=self.prepared.num_tokens)

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.router.in_flight -= 1

    async def _run(self) -> Any:
        router, prepared, ctx = self.router, self.prepared, self.ctx
        info = prepared.route
        texts: list[str] = prepared.inputs
        attempts = router.attempts(ctx)
        plan = router.plan(prepared, ctx)

        async def call(target: Target) -> Any:
            return await _encode(target, texts, ctx, prepared)

        output = await attempts.run(plan, info, call)
        if router.options.kind == "cascade" and info.served_by == plan[0][0].name:
            output = await self._cascade(output, texts, info)
        router.routed(info)
        if router.shadow is not None:
            router.shadow.maybe_copy(texts, output, ctx)
        return output

    async def _cascade(self, small: np.ndarray, texts: list[str], info: RouteInfo) -> Any:
        router = self.router
        from sokuji.runtimes.classifier import margin as margins

        assert router.threshold is not None
        margin = margins(small)
        unsure = np.flatnonzero(margin < router.threshold)
        info.detail = f"margin {float(margin.min()):.3f}"
        if not len(unsure):
            info.reason = "cascade_kept"
            return small
        large = router.targets[router.options.targets[1]]
        sub = [texts[i] for i in unsure]
        inner = PreparedRoute(sub, sum(map(len, sub)), "embed", num_items=len(sub))
        try:
            rows = await router.attempts(self.ctx).run(
                [(large, "cascade_escalated")], inner.route,
                lambda t: _encode(t, sub, self.ctx, inner))
        except SokujiError:
            if any(o == "client" for _, o, _ in inner.route.attempts):
                raise
            info.attempts += inner.route.attempts
            info.reason = "cascade_kept:large_unavailable"
            return small
        info.attempts += inner.route.attempts
        out = np.array(small, copy=True)
        out[unsure] = rows
        info.served_by = large.name if len(unsure) == len(texts) else \
            f"{info.served_by}+{large.name}"
        info.reason = "cascade_escalated"
        info.detail += f" escalated {len(unsure)}/{len(texts)}"
        return out


async def _encode(target: Target, texts: list[str], ctx: RequestContext,
                  prepared: PreparedRoute) -> Any:
    model = target.model
    inner = await model.prepare(texts, ctx)
    handle = model.submit(inner, ctx)  # (admitted there: a full target refuses, 429)
    try:
        out = await handle.result()
    except asyncio.CancelledError:
        handle.cancel()
        raise
    prepared.num_tokens = handle.report.input_tokens
    return out


class RouteTiming:
    """The answering target's ``Timing``, the route's entry in front; before a target
    answers, a plain one from the request's arrival."""

    def __init__(self, arrival_ns: int, info: RouteInfo) -> None:
        self.inner: Any = Timing(arrival_ns)
        self.info = info

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def timing_entries(self) -> list[Any]:
        return [self.info.timing_entry(), *self.inner.timing_entries()]

    def server_timing(self) -> str:
        from sokuji.core import timing

        return timing.render(self.timing_entries())


class RouteGeneration(EventStream):
    def __init__(self, router: Router, prepared: PreparedRoute, ctx: RequestContext,
                 timing: Any = None):
        self.router = router
        self.prepared = prepared
        self.ctx = ctx
        self.info = prepared.route
        self.given_timing = timing
        """A pipeline's: the target stamps it (and it is what the caller reports)."""
        self.timing = timing if timing is not None else RouteTiming(ctx.arrival_ns, self.info)
        self.gen: Any = None
        self.cancelled = False
        router.in_flight += 1
        self._open = True
        self._first: asyncio.Task[list[Any]] | None = None

    @property
    def report(self) -> Report:
        """The target that answers (known once the first events came)."""
        return Report(served_by=self.info.served_by)

    async def next_events(self) -> list[Any]:
        if self.gen is not None:
            events = await self.gen.next_events()
            if events and isinstance(events[-1], Finish):
                self._close()
            return events
        if self._first is None:
            self._first = asyncio.ensure_future(self._start())
        try:
            events = await self._first
        except asyncio.CancelledError:
            self._close()
            return [Finish("cancelled", 0)]
        except SokujiError as exc:
            self._close()
            return [Finish("error", 0, exc)]
        self.router.routed(self.info)
        if events and isinstance(events[-1], Finish):
            self._close()
        return events

    async def _start(self) -> list[Any]:
        if self.router.options.kind == "cascade":
            return await self._cascade()
        return await self._attempt(self.prepared.inputs, self.router.plan(self.prepared, self.ctx),
                                   self.info)

    async def _cascade(self) -> list[Any]:
        """The small generator answers whole, with its tokens' log-probabilities (asked for
        here if the client did not ask: then not relayed); its mean is its confidence. At or
        above the threshold its answer stands; below, the large one answers (its stream
        relayed), unless it cannot: then the small one's answer stands."""
        router, req, info = self.router, self.prepared.inputs, self.info
        asked = req.logprobs is not None
        inner = req if asked else dataclasses.replace(req, logprobs=0)
        events = await self._attempt(inner, router.plan(self.prepared, self.ctx), info)
        while not isinstance(events[-1], Finish):
            events += await self.gen.next_events()
        logprobs = [lp.logprob for e in events if isinstance(e, Delta) for lp in e.logprobs]
        confidence = sum(logprobs) / len(logprobs) if logprobs else float("-inf")
        if not asked:
            events = [dataclasses.replace(e, logprobs=()) if isinstance(e, Delta) else e
                      for e in events]
        assert router.threshold is not None
        info.detail = f"confidence {confidence:.3f}"
        small = router.options.targets[0]
        if info.served_by != small or confidence >= router.threshold \
                or events[-1].error is not None:
            info.reason = info.reason if info.served_by != small else "cascade_kept"
            return events
        large = router.targets[router.options.targets[1]]
        escalated = RouteInfo()
        try:
            out = await self._attempt(req, [(large, "cascade_escalated")], escalated)
        except SokujiError:
            info.attempts += escalated.attempts
            if any(o == "client" for _, o, _ in escalated.attempts):
                raise
            info.reason = "cascade_kept:large_unavailable"
            return events
        info.attempts += escalated.attempts
        info.served_by, info.reason = large.name, "cascade_escalated"
        return out

    async def _attempt(self, req: Any, plan: list[tuple[Target, str]], info: RouteInfo
                       ) -> list[Any]:
        """The first events of the first target in ``plan`` that starts answering."""
        router, ctx = self.router, self.ctx

        async def call(target: Target) -> list[Any]:
            model = target.model
            inner = await model.prepare(req, ctx)
            gen: Any = model.submit(inner, ctx) if self.given_timing is None else \
                model.submit(inner, ctx, timing=self.given_timing)  # type: ignore[call-arg]
            try:
                events = await gen.next_events()
            except BaseException:
                gen.cancel()
                raise
            first = events[0] if events else None
            if isinstance(first, Finish) and first.error is not None:
                gen.cancel()
                raise first.error
            self.gen = gen
            if self.given_timing is None:
                self.timing.inner = gen.timing
            return events

        return await router.attempts(ctx).run(plan, info, call)

    def cancel(self) -> None:
        self.cancelled = True
        if self.gen is not None:
            self.gen.cancel()
        elif self._first is not None:
            self._first.cancel()
        self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.router.in_flight -= 1
