"""A traced request's W3C trace context in flight: span ids, the ``traceparent`` it sends
upstream, and its upstream hops. Plain data, no OpenTelemetry: the sampling decision and the
spans built after the answer are ``observability/tracing.py``'s; the ``Trace`` a request
carries is ``core/model.py``'s, beside the ``RequestContext`` that holds it."""

from __future__ import annotations

import random
import time

TRACEPARENT = "traceparent"
_getrandbits = random.getrandbits


def new_span_id() -> int:
    return _getrandbits(64) or 1


def header(trace_id: int, span_id: int) -> str:
    """A sampled ``traceparent`` naming ``span_id`` as the parent."""
    return f"00-{trace_id:032x}-{span_id:016x}-01"


class Hop:
    """An upstream call of a traced request: a CLIENT span, the parent of the upstream's."""

    __slots__ = ("end_ns", "name", "outcome", "span_id", "start_ns", "url")

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url
        self.span_id = new_span_id()
        self.start_ns = time.perf_counter_ns()
        self.end_ns = 0
        self.outcome: int | str = ""
        """The upstream's HTTP status, or a word (``upstream_http.OnAttempt``)."""

    def end(self, outcome: int | str) -> None:
        """An attempt ended (the last one's outcome and end stand: a safe retry extends
        the hop)."""
        self.end_ns = time.perf_counter_ns()
        self.outcome = outcome


class _NoHop(Hop):
    """An untraced call's: ``end`` does nothing."""

    __slots__ = ()

    def __init__(self) -> None:
        self.span_id = 0

    def end(self, outcome: int | str) -> None:
        pass


NO_HOP: Hop = _NoHop()
