"""One ``/metrics`` for the whole deployment: every replica's series, labelled by replica.

Behind HAProxy a scrape of ``/metrics`` lands on whichever replica is least busy, so a
replica answering with only its own counters would make Prometheus see them jump between
replicas. Instead each replica pushes its exposition to a small Ray actor (the hub, one per
application, created by whichever replica asks first) every ``push_s``, and the replica that
gets the scrape answers with all of them merged: each sample gains a ``replica`` label, one
``# HELP`` / ``# TYPE`` per family. Its own figures are rendered fresh; the others' are at
most ``push_s`` old, and a replica that stopped pushing (stopped, or died) drops out after
three intervals. Prometheus, Grafana and the project's dashboard queries (``sum by``) work
unchanged; ``/metrics?scope=replica`` gives one replica's own.

The hub lives as long as the replica that created it; if that replica goes, the next push
from any replica creates a new hub (pushes carry full expositions, so nothing is rebuilt).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import RayError

from sokuji.observability.metrics import Metrics

log = logging.getLogger(__name__)
REPLICA_LABEL = "replica"


@ray.remote(num_cpus=0)
class MetricsHub:
    """The latest exposition of every replica of one application."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self.latest[replica] = (time.monotonic(), text)

    def collect(self, max_age_s: float) -> dict[str, bytes]:
        cutoff = time.monotonic() - max_age_s
        self.latest = {r: v for r, v in self.latest.items() if v[0] >= cutoff}
        return {r: v[1] for r, v in self.latest.items()}


class ClusterMetrics:
    """A replica's side: push its own exposition, answer a scrape with everyone's."""

    def __init__(self, app_name: str, replica: str, metrics: Metrics,
                 push_s: float = 5.0) -> None:
        self.name = f"sokuji-metrics-{app_name}"
        self.replica = replica
        self.metrics = metrics
        self.push_s = push_s
        self._hub: Any = None
        self._task: asyncio.Task[None] | None = None

    def hub(self) -> Any:
        if self._hub is None:
            self._hub = MetricsHub.options(  # type: ignore[attr-defined]
                name=self.name, namespace="sokuji", get_if_exists=True).remote()
        return self._hub

    async def _call(self, method: str, *args: Any) -> Any:
        """A hub call; a hub that died (its creator went) is replaced once."""
        for attempt in (1, 2):
            try:
                return await getattr(self.hub(), method).remote(*args)
            except RayError:
                self._hub = None
                if attempt == 2:
                    raise
        return None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._push_forever())

    async def _push_forever(self) -> None:
        while True:
            try:
                await self._call("put", self.replica, self.metrics.render())
            except RayError as exc:  # the next push tries again; scrapes use what there is
                log.warning("metrics push to the hub failed: %s", exc)
            await asyncio.sleep(self.push_s)

    async def render(self) -> bytes:
        """Every live replica's series (this one's rendered now), merged."""
        own = self.metrics.render()
        try:
            texts = await self._call("collect", 3 * self.push_s)
        except RayError as exc:
            log.warning("metrics hub unreachable, answering with this replica's: %s", exc)
            texts = {}
        texts[self.replica] = own
        return merge(texts)


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge(texts: dict[str, bytes]) -> bytes:
    """Prometheus expositions by replica -> one, each sample labelled ``replica``."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value,
                                  s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)
