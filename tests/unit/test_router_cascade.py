"""The cascade's handles (``routing/submission.py``) over stand-in models whose answers the
test sets: for classifiers (``RouteSubmission._cascade``), which items escalate, how the
large one's rows merge back, and what happens when the large one cannot answer; for
generators (``RouteGeneration._cascade``), the same decision on the answer's mean token
log-probability, and the small answer standing when the large one fails.
(The real classifiers and ``sokuji route calibrate``: ``tests/integration/
test_classifier_cascade.py``.)"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from sokuji.core.events import Delta, Finish, TokenLogprob
from sokuji.core.model import GenerationInput, Report, RequestContext
from sokuji.core.request import Priority
from sokuji.errors import InvalidInput, RuntimeFailed, SokujiError
from sokuji.routing.attempts import Attempts, PreparedRoute, RouteInfo, Target
from sokuji.routing.breaker import Breaker
from sokuji.routing.config import BreakerOptions, RouterOptions
from sokuji.routing.submission import RouteGeneration, RouteSubmission

THRESHOLD = 0.25


def scores(margin: float) -> list[float]:
    """A row of three class scores whose margin (top-1 minus top-2) is ``margin``."""
    return [0.5, 0.5 - margin, 0.0]


class Handle:
    def __init__(self, model: Classifier, texts: list[str]) -> None:
        self.model, self.texts = model, texts
        self.report = Report(input_tokens=len(texts))

    async def result(self) -> np.ndarray:
        self.model.calls.append(self.texts)
        if self.model.fail is not None:
            raise self.model.fail
        return np.asarray([self.model.rows[t] for t in self.texts], dtype=np.float32)

    def cancel(self) -> None:
        pass


@dataclass
class Classifier:
    rows: dict[str, list[float]]
    fail: SokujiError | None = None
    calls: list[list[str]] = field(default_factory=list)

    async def prepare(self, texts: list[str], ctx: RequestContext) -> list[str]:
        return list(texts)

    def submit(self, texts: list[str], ctx: RequestContext) -> Handle:
        return Handle(self, texts)


class Router:
    """What ``RouteSubmission`` reads of ``router.RouterModel``."""

    def __init__(self, small: Classifier, large: Classifier) -> None:
        self.in_flight = 0
        self.options = RouterOptions(kind="cascade", targets=("small", "large"),
                                     threshold=THRESHOLD)
        breaker = BreakerOptions(failures=1)
        self.targets = {name: Target(name, model, Breaker(name, breaker))  # type: ignore[arg-type]
                        for name, model in (("small", small), ("large", large))}
        self.threshold = THRESHOLD
        self.shadow = None
        self.routes: list[RouteInfo] = []

    def attempts(self, ctx: RequestContext) -> Attempts:
        return Attempts("r", ctx, self.options)

    def plan(self, prepared: PreparedRoute, ctx: RequestContext) -> list[tuple[Target, str]]:
        return [(self.targets["small"], "cascade")]

    def routed(self, info: RouteInfo) -> None:
        self.routes.append(info)


SMALL_MARGINS = {"sure": 0.5, "unsure": 0.01, "also sure": 0.4, "borderline": THRESHOLD,
                 "also unsure": 0.1}
"""``borderline``'s margin is the threshold itself: kept (escalated only below it)."""


def classifiers() -> tuple[Classifier, Classifier]:
    small = Classifier({t: scores(m) for t, m in SMALL_MARGINS.items()})
    large = Classifier({t: [float(i), 10.0 + i, 0.0] for i, t in enumerate(SMALL_MARGINS)})
    return small, large


async def route(router: Router, texts: list[str]) -> tuple[np.ndarray, RouteInfo]:
    prepared = PreparedRoute(texts, sum(map(len, texts)), "embed", num_items=len(texts))
    ctx = RequestContext("t", Priority.INTERACTIVE, None, time.perf_counter_ns())
    out = await RouteSubmission(router, prepared, ctx).result()  # type: ignore[arg-type]
    assert router.in_flight == 0
    return out, prepared.route


async def test_only_items_below_the_threshold_escalate_and_their_rows_merge_in_order() -> None:
    """Kills the mutants: escalating at or above the threshold (``<=`` / ``>``) instead of
    below it, escalating the whole request, and merging the large rows anywhere but at the
    escalated items' own positions (in order) in ``routing/submission.py`` ``_cascade``."""
    small, large = classifiers()
    texts = list(SMALL_MARGINS)
    out, info = await route(Router(small, large), texts)
    assert large.calls == [["unsure", "also unsure"]]  # those alone, in the request's order
    unsure = {"unsure", "also unsure"}
    want = [large.rows[t] if t in unsure else small.rows[t] for t in texts]
    np.testing.assert_array_equal(out, np.asarray(want, dtype=np.float32))
    assert info.served_by == "small+large" and info.reason == "cascade_escalated"
    assert info.detail == "margin 0.010 escalated 2/5"
    assert [(t, o) for t, o, _ in info.attempts] == [("small", "ok"), ("large", "ok")]


async def test_a_sure_request_never_calls_the_large_model() -> None:
    small, large = classifiers()
    out, info = await route(Router(small, large), ["sure", "borderline"])
    assert large.calls == [] and info.served_by == "small"
    assert info.reason == "cascade_kept" and info.detail == "margin 0.250"
    np.testing.assert_array_equal(out, np.asarray([small.rows["sure"],
                                                   small.rows["borderline"]], np.float32))


async def test_all_unsure_is_answered_by_the_large_model_alone() -> None:
    small, large = classifiers()
    out, info = await route(Router(small, large), ["also unsure", "unsure"])
    assert large.calls == [["also unsure", "unsure"]] and info.served_by == "large"
    np.testing.assert_array_equal(out, np.asarray([large.rows["also unsure"],
                                                   large.rows["unsure"]], np.float32))


async def test_the_small_answer_stands_when_the_large_model_cannot_answer() -> None:
    """Kills the mutant: letting the large model's failure (or its open breaker) fail the
    request in ``_cascade``: a cascade degrades to its small model, never to an error."""
    small, large = classifiers()
    large.fail = RuntimeFailed("the large classifier crashed")
    router = Router(small, large)
    texts = ["sure", "unsure"]
    for expected in ("error", "open"):  # the failure opens its breaker (failures = 1)
        out, info = await route(router, texts)
        np.testing.assert_array_equal(out, np.asarray([small.rows[t] for t in texts],
                                                      np.float32))
        assert info.served_by == "small" and info.reason == "cascade_kept:large_unavailable"
        assert [(t, o) for t, o, _ in info.attempts] == [("small", "ok"), ("large", expected)]
    assert len(large.calls) == 1  # the open breaker skipped it without a call


async def test_a_client_error_from_the_large_model_is_the_clients() -> None:
    small, large = classifiers()
    large.fail = InvalidInput("too long for the large model", param="text")
    with pytest.raises(InvalidInput, match="too long"):
        await route(Router(small, large), ["unsure"])


def test_the_handle_counts_itself_out_when_cancelled() -> None:
    small, large = classifiers()
    router = Router(small, large)
    prepared = PreparedRoute(["sure"], 4, "embed", num_items=1)
    handle = RouteSubmission(router, prepared,  # type: ignore[arg-type]
                             RequestContext("t", Priority.INTERACTIVE, None, 0))
    assert router.in_flight == 1
    handle.cancel()
    handle.cancel()
    assert router.in_flight == 0


# -- the generation cascade (``RouteGeneration._cascade``) --------------------------------------
class Stream:
    """A generation's events: ``text`` in one delta, each token's log-probability ``lp``."""

    def __init__(self, model: Generator) -> None:
        self.model = model
        self.timing = None
        self.sent = False

    async def next_events(self) -> list[Any]:
        m = self.model
        if m.fail is not None:
            return [Finish("error", 0, m.fail)]
        if self.sent:
            return []
        self.sent = True
        lps = tuple(TokenLogprob(c, c.encode(), m.lp, i) for i, c in enumerate(m.text))
        return [Delta(m.text, len(m.text), lps), Finish("stop", len(m.text))]

    def cancel(self) -> None:
        pass


@dataclass
class Generator:
    text: str
    lp: float
    fail: SokujiError | None = None
    asked: list[Any] = field(default_factory=list)

    async def prepare(self, req: Any, ctx: RequestContext) -> Any:
        self.asked.append(req)
        return req

    def submit(self, req: Any, ctx: RequestContext) -> Stream:
        return Stream(self)


def _question(logprobs: int | None = None) -> GenerationInput:
    return GenerationInput(True, [{"role": "user", "content": "capital of France?"}], None,
                           8, "max_tokens", 0, False, 0.0, 1.0, (), None, logprobs=logprobs)


async def generate(small: Generator, large: Generator, logprobs: int | None = None
                   ) -> tuple[list[Any], RouteInfo]:
    router = Router(small, large)  # type: ignore[arg-type]
    router.threshold = -1.0  # a mean token log-probability below it escalates
    prepared = PreparedRoute(_question(logprobs), 18, "chat")
    ctx = RequestContext("t", Priority.INTERACTIVE, None, time.perf_counter_ns())
    handle = RouteGeneration(router, prepared, ctx)  # type: ignore[arg-type]
    events: list[Any] = []
    while not events or not isinstance(events[-1], Finish):
        events += await handle.next_events()
    assert router.in_flight == 0
    return events, prepared.route


def _text(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


async def test_a_generation_escalates_below_the_threshold_and_stands_at_or_above_it() -> None:
    """Kills the mutants: escalating at the threshold (``>`` for ``>=``) or never."""
    for lp in (-0.2, -1.0):  # above; at the threshold itself
        events, info = await generate(Generator("Paris", lp), Generator("Lyon", -0.1))
        assert _text(events) == "Paris" and info.reason == "cascade_kept", lp
    assert all(not e.logprobs for e in events if isinstance(e, Delta))  # asked for, not relayed
    events, info = await generate(Generator("Paris?", -2.0), Generator("Paris", -0.1))
    assert _text(events) == "Paris" and info.served_by == "large"
    assert info.reason == "cascade_escalated" and info.detail == "confidence -2.000"


async def test_the_small_generation_stands_when_the_large_one_cannot_answer() -> None:
    """Kills the mutant: letting the large generator's failure fail the request in
    ``routing/submission.py`` ``RouteGeneration._cascade`` (it must degrade to the small
    answer), or relaying the large one's error event instead."""
    large = Generator("never", 0.0, fail=RuntimeFailed("the large generator crashed"))
    events, info = await generate(Generator("Paris?", -2.0), large)
    assert _text(events) == "Paris?" and events[-1].reason == "stop"
    assert events[-1].error is None
    assert info.served_by == "small" and info.reason == "cascade_kept:large_unavailable"
    assert [(t, o) for t, o, _ in info.attempts] == [("small", "ok"), ("large", "error")]


async def test_a_client_error_from_the_large_generator_is_the_clients() -> None:
    large = Generator("never", 0.0, fail=InvalidInput("prompt too long", param="messages"))
    events, _ = await generate(Generator("Paris?", -2.0), large)
    assert events[-1].reason == "error" and isinstance(events[-1].error, InvalidInput)
