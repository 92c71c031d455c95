"""Where a request's end is counted, once, whatever its protocol (V2, embeddings, a
generation, a stream, a job replayed through the inference path): ``sokuji_requests_total``
by model and status, Triton's statistics (the Timeline's row, or a failure's time), the SLOs,
the GenAI conventions' metrics and the request's spans when it is traced. The endpoints
only say how the request ended; what is observed from it is decided here.

A request refused for its key (401, or 403: the tenant may not use the model) counts in
``sokuji_auth_failures_total`` only, never in a model's figures: anyone can send one, so
counting it against the model it names would let anyone inflate that model's failures and
spend a tenant's error budget. A failure after authorisation counts for the model and, in
the SLOs, for the caller's own tenant.

What is published after the reply is written goes through ``call_soon``, off the request's
own latency."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sokuji.core.events import Finish
from sokuji.core.request import Stage, Timeline
from sokuji.errors import ModelNotFound, SokujiError
from sokuji.observability import tracing
from sokuji.observability.metrics import Metrics
from sokuji.repository.models import Model, ModelRepository

AUTH_STATUSES = (401, 403)
"""Refusals for the key: counted in ``sokuji_auth_failures_total``, never for a model."""


class Accounting:
    def __init__(self, repo: ModelRepository, metrics: Metrics,
                 tracer: tracing.Tracer | None = None) -> None:
        self.repo = repo
        self.metrics = metrics
        self.tracer = tracer

    # -- a request answered from its Timeline (V2 infer, embeddings, jobs) ------------------
    def answered(self, model: Model, tenant: str, tl: Timeline, operation: str, name: str,
                 path: str, trace: tracing.Trace | None) -> None:
        """A 200 for ``name`` (as the request named it) served by ``model`` (the version
        that served: statistics are per version)."""
        metrics = self.metrics
        if metrics.slo is not None:
            metrics.observe_slo(name, tenant, tl.total_ns / 1e6, 200)
        loop = asyncio.get_running_loop()
        loop.call_soon(metrics.observe_request, model.metric_name, tl, 200)
        metrics.genai.request(operation, name, tl.total_ns)
        if trace is not None:
            assert self.tracer is not None
            loop.call_soon(self.tracer.end_request, trace, operation, name, model.metric_name,
                           tl, 200, path, None)

    def failed(self, name: str, version: str | None, error: SokujiError, t0: int | None,
               tenant: str | None = None, trace: tracing.Trace | None = None,
               operation: str = "", tl: Timeline | None = None, path: str = "",
               exc: BaseException | None = None) -> None:
        """An error reply for a request naming model ``name`` (a known one counts it in its
        metrics, statistics and, with a ``tenant``, its SLOs); ``t0``: its arrival. A refusal
        for the key counts in ``sokuji_auth_failures_total`` instead (``unauthorised``)."""
        if error.status in AUTH_STATUSES:
            self.unauthorised(error)
        elif name in self.repo.models:
            metrics = self.metrics
            metrics.requests.labels(name, str(error.status)).inc()
            if metrics.slo is not None and tenant is not None:
                metrics.observe_slo(name, tenant, None, error.status)
            try:
                model = self.repo.get(name, version)
            except ModelNotFound:  # an unknown version: no statistics to count it in
                model = None
            if model is not None:
                elapsed_ns = time.perf_counter_ns() - t0 if t0 is not None else 0
                metrics.observe_failure(model.metric_name, elapsed_ns)
        if trace is not None:
            assert self.tracer is not None and tl is not None
            asyncio.get_running_loop().call_soon(
                self.tracer.end_request, trace, operation, name, "", tl, error.status, path,
                exc)

    def unauthorised(self, error: SokujiError) -> None:
        """A request refused for its key (401 or 403), before or at authorisation: counted
        with no model or tenant label. Any other error (a 405 before the key was read) is
        not counted: who sent it is not known."""
        if error.status in AUTH_STATUSES:
            self.metrics.auth_failures.labels(str(error.status)).inc()

    def left(self, name: str) -> None:
        """A stream whose client went away (or stopped reading) before its end: counted as
        499, as a cancelled generation is."""
        self.metrics.requests.labels(name, "499").inc()

    def streamed(self, model: Model, t0: int) -> None:
        """A stream (``Api.STREAM``) answered to its end: its whole time as ``infer``."""
        tl = Timeline(t0)
        tl.mark(Stage.INFER)
        self.metrics.observe_request(model.metric_name, tl, 200)

    # -- a generation (chat, text completion) -----------------------------------------------
    def refused(self, name: str, tenant: str, error: SokujiError, t0: int, operation: str,
                path: str, model: str, trace: tracing.Trace | None,
                exc: BaseException) -> None:
        """A generation refused before submission (``name``: the model, when known)."""
        metrics = self.metrics
        if error.status in AUTH_STATUSES:
            self.unauthorised(error)
        elif name:
            metrics.observe_failure(name, time.perf_counter_ns() - t0)
            if metrics.slo is not None:
                metrics.observe_slo(name, tenant, None, error.status)
            metrics.requests.labels(name, str(error.status)).inc()
        if trace is not None:
            assert self.tracer is not None
            asyncio.get_running_loop().call_soon(
                self.tracer.end_generation, trace, operation, model, None, None, None,
                error.status, path, exc)

    def generated(self, name: str, tenant: str, gen: Any, finish: Finish | None,
                  failure: SokujiError | None, operation: str, request: Any, path: str,
                  trace: tracing.Trace | None) -> None:
        """A submitted generation ended: ``finish`` (None: a bug before one came),
        ``failure`` (what an error reply answered; None: the answer was sent, or the client
        left)."""
        metrics = self.metrics
        ended = 200 if finish is None else finish.error.status if finish.error is not None \
            else 499 if finish.reason == "cancelled" else 200
        status = failure.status if failure is not None else ended
        metrics.requests.labels(name, str(status)).inc()
        cached = gen.report.cached
        loop = asyncio.get_running_loop()
        if finish is not None and not cached:  # engine, tokens, the dashboard, statistics
            loop.call_soon(metrics.observe_generation, name, gen.timing,
                           finish.completion_tokens, ended, False)
        if metrics.slo is not None:  # a generator's SLO is on the time to first token
            timing = gen.timing
            first = timing.first_token_ns
            ttft_ms = (first - timing.arrival_ns) / 1e6 if first else None
            slo_status = failure.status if failure is not None else 200
            if ttft_ms is not None or slo_status != 200:
                metrics.observe_slo(name, tenant, ttft_ms, slo_status)
        if status == 200 and not cached:
            metrics.genai.generation(operation, name, gen.timing)
        if trace is not None:
            assert self.tracer is not None
            loop.call_soon(self.tracer.end_generation, trace, operation, name, request,
                           gen.timing, finish, status, path, None)
