"""Scale-out on Ray Serve, 1 to 100 replicas: throughput, p99 and cost from one replica.

``sokuji serve --ray`` runs one whole Sokuji per replica behind HAProxy (Ray Serve's fast
path, ``leastconn``). This model starts from what was measured on ONE replica and adds
replicas on paper:

1. **One replica under Ray** = the single-process fit (``fit.py``: batches of b hold the
   core ``base + per_item x b``, a lone request ``inline``, its spread, the time outside)
   + Ray's measured cost per request: ``replica_cpu_ms`` more of the replica's core (Serve's
   direct-ingress wrapper, its metrics; added to the server's own work per request) and
   ``hop_ms`` more outside it (the HAProxy hop, on other cores).
2. **N replicas** each on cores of their own (``cores_per_replica``), fed by one balancer:
   ``leastconn`` sends each request to the replica with the fewest requests in flight
   (simulated: N copies of ``simulate.py``'s replica behind a join-the-shortest-queue
   dispatcher, Poisson arrivals at the total rate), or ``random`` (the planner's even split:
   each replica sees rate / N, exactly one replica's figures - an upper bound on p99).
3. **The balancer**: HAProxy costs ``balancer_cpu_ms`` of CPU a request, on its own cores
   (``nbthread``, 4 by default): it takes at most ``threads x 1000 / balancer_cpu_ms``
   requests a second, beyond which the table marks the row (more balancers are not modelled).
4. **Cost**: cores = replicas x cores_per_replica + the balancer's share (rate x its CPU a
   request) + Ray's idle background; $ per 1M requests at a price per core-hour. Memory =
   Ray's fixed cluster memory (head node) + per extra node (raylet, agents) + replicas x
   one replica's RSS, nodes of ``cores_per_node`` cores.

Assumptions (stated in every result): replicas are independent and scale linearly (no shared
memory bandwidth, caches or Ray control-plane limits: Serve's controller and autoscaling
were not measured past 2 replicas); the network is not modelled (one machine's loopback
was measured: a cross-node hop adds its round trip to every request); Poisson arrivals;
HAProxy's leastconn count = requests in flight at each replica.

``python -m sokuji.plan.scaleout RECORD.json`` (proposed: ``sokuji plan --ray RECORD.json``)
prints the table from a recorded ``benchmarks/ray_scaleout.py`` run (its ``model_inputs``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sokuji.bench.schedule import Arrivals, intended_times
from sokuji.plan import simulate
from sokuji.plan.fit import EncoderFit
from sokuji.plan.simulate import _Deviations, _outside_s, _run_ms

REPLICA_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80, 100)
ASSUMPTIONS = (
    "replicas are independent and scale linearly (each on cores of its own; no shared "
    "memory bandwidth or Ray control-plane limit modelled; Serve's controller was measured "
    "with 2 replicas only)",
    "one HAProxy (nbthread threads, each a core) balances with leastconn = requests in "
    "flight per replica; past its capacity the row is marked, more balancers not modelled",
    "network not modelled: loopback measured; a cross-node hop adds its round trip",
    "Poisson arrivals; the replica's service time is the single-process fit plus Ray's "
    "measured CPU per request (one replica's batching behaviour is kept)",
)


@dataclass(frozen=True)
class RayCosts:
    """What Ray adds, measured on one replica against single-process Sokuji."""

    replica_cpu_ms: float
    """More of the replica's core per request than single-process Sokuji spends."""
    hop_ms: float
    """More latency per request at idle (the balancer hop), outside the replica's core."""
    balancer_cpu_ms: float
    """HAProxy's CPU per request."""
    replica_mb: float
    """One replica's resident memory."""
    cluster_mb: float = 830.0
    """Ray's fixed memory on the head node (GCS, raylet, agents, Serve's controller)."""
    node_mb: float = 314.0
    """Per extra node: raylet, dashboard and runtime-env agents, log monitor (research §6)."""
    background_cores: float = 0.1
    """Ray's CPU while idle (controller loop, raylet, GCS)."""
    balancer_threads: int = 4

    def balancer_capacity_rps(self) -> float:
        if self.balancer_cpu_ms <= 0:
            return math.inf
        return self.balancer_threads * 1e3 / self.balancer_cpu_ms


def ray_replica(single: EncoderFit, costs: RayCosts, colocated_cpu_ms: float = 0.0
                ) -> EncoderFit:
    """One replica under Ray: ``single``'s fit with Ray's CPU per request (+ the CPU of
    anything else sharing the replica's core per request, ``colocated_cpu_ms``: a balancer
    or a load generator on the same machine) added to the server's own work per request,
    and the hop added to the time outside."""
    extra = costs.replica_cpu_ms + colocated_cpu_ms
    return replace(single, per_item_ms=single.per_item_ms + extra,
                   inline_ms=single.inline_ms + extra, overhead_ms=single.overhead_ms + extra,
                   reject_ms=single.reject_ms + extra,
                   outside_ms=single.outside_ms + costs.hop_ms,
                   outside=single.outside + costs.hop_ms)


def leastconn_loop(arrival_s: np.ndarray, replicas: int, service: simulate.Service, *,
                   max_batch: int, queue_depth: int | None = None,
                   outside_ms: simulate.Outside = 0.0, seed: int = 0) -> simulate.Outcome:
    """``arrival_s`` through ``replicas`` copies of ``simulate.open_loop``'s replica, each
    request sent to the replica with the fewest in flight (queued + running; among idle ones
    the one idle longest, as round robin). A refusal (queue full) costs no core time here.
    With one replica it is ``open_loop`` without the refusals' cost."""
    n = len(arrival_s)
    max_batch = min(max_batch, service.max_batch)
    depth = n if queue_depth is None else queue_depth
    rng = np.random.default_rng(seed)
    devs = _Deviations(service, rng, n + 1)
    mean = service.mean_ms
    inline = mean[1] if service.inline_ms is None else service.inline_ms
    done = np.full(n, np.nan)
    queues: list[deque[int]] = [deque() for _ in range(replicas)]
    running: list[list[int]] = [[] for _ in range(replicas)]
    in_flight = np.zeros(replicas, dtype=np.int64)
    idle: deque[int] = deque(range(replicas))
    ends: list[tuple[float, int]] = []  # (batch end, replica)
    sizes: list[int] = []
    busy, n_inline = 0.0, 0

    def start(r: int, at: float, lone: bool) -> None:
        nonlocal busy, n_inline
        q = queues[r]
        b = min(len(q), max_batch)
        batch = [q.popleft() for _ in range(b)]
        run_s = _run_ms(inline if lone and b == 1 else mean[b], devs.take(b)) / 1e3
        n_inline += lone and b == 1
        busy += run_s
        running[r] = batch
        sizes.append(b)
        heapq.heappush(ends, (at + run_s, r))

    def finish_until(t: float) -> None:
        while ends and ends[0][0] <= t:
            end, r = heapq.heappop(ends)
            batch = running[r]
            done[batch] = end
            in_flight[r] -= len(batch)
            running[r] = []
            if queues[r]:
                start(r, end, lone=False)
            else:
                idle.append(r)

    for i in range(n):
        t = float(arrival_s[i])
        finish_until(t)
        if idle:
            r = idle.popleft()
        else:
            r = int(np.argmin(in_flight))
            if len(queues[r]) >= depth:
                continue  # refused
        queues[r].append(i)
        in_flight[r] += 1
        if not running[r]:
            start(r, t, lone=True)
    finish_until(math.inf)
    return simulate.Outcome(arrival_s, done, done - arrival_s + _outside_s(outside_ms, rng, n),
                            np.asarray(sizes, dtype=np.int64), busy / replicas, n_inline)


@dataclass(frozen=True)
class Sim:
    requests: int = 40_000
    """Simulated requests per prediction, over all seeds."""
    seeds: int = 4
    min_services: float = 200.0


def predict(fit: EncoderFit, replicas: int, rate: float, *, balance: str = "leastconn",
            sim: Sim | None = None, first_seed: int = 0) -> simulate.Figures:
    """``replicas`` replicas of ``fit`` at ``rate`` requests a second in all (Poisson)."""
    sim = sim or Sim()
    service = fit.service()
    # Enough requests for the p99, and at least min_services lone service times (the
    # queues' memory) per run; 20% of it warm-up.
    floor = sim.min_services * service.mean_ms[1] / 1e3
    seconds = max(floor, sim.requests / (sim.seeds * rate))
    warmup = 0.2 * seconds
    if balance == "random":  # an even random split: each replica sees rate / N, Poisson
        each = rate / replicas
        seconds = max(floor, sim.requests / (sim.seeds * each))
        one = simulate.poisson_load(each, service, max_batch=fit.max_batch,
                                    queue_depth=fit.queue_depth, outside_ms=fit.open_outside,
                                    seconds=seconds, warmup_s=0.2 * seconds, seeds=sim.seeds,
                                    first_seed=first_seed)
        return replace(one, rate=rate, throughput_rps=one.throughput_rps * replicas)
    if balance != "leastconn":
        raise ValueError(f"balance must be leastconn or random, not {balance!r}")
    outcomes = []
    for s in range(first_seed, first_seed + sim.seeds):
        times = intended_times(rate, Arrivals.POISSON, 1000 + s, duration_s=warmup + seconds)
        outcomes.append(leastconn_loop(times, replicas, service, max_batch=fit.max_batch,
                                       queue_depth=fit.queue_depth,
                                       outside_ms=fit.open_outside, seed=s))
    return simulate.figures(outcomes, rate, warmup)


@dataclass(frozen=True)
class Pricing:
    price_per_core_hour: float | None = None
    cores_per_replica: int = 1
    cores_per_node: int = 16


def resources(costs: RayCosts, replicas: int, rate: float, pricing: Pricing
              ) -> dict[str, Any]:
    """Cores, memory and cost of ``replicas`` at ``rate`` requests a second."""
    balancer_cores = rate * costs.balancer_cpu_ms / 1e3
    cores = replicas * pricing.cores_per_replica + balancer_cores + costs.background_cores
    nodes = max(1, math.ceil(cores / pricing.cores_per_node))
    out: dict[str, Any] = {
        "cores": cores, "balancer_cores": balancer_cores, "nodes": nodes,
        "memory_mb": costs.cluster_mb + (nodes - 1) * costs.node_mb
        + replicas * costs.replica_mb}
    price = pricing.price_per_core_hour
    if price is not None:
        out["per_hour"] = cores * price
        out["per_1m_requests"] = cores * price / (rate * 3600) * 1e6 if rate > 0 else None
    return out


@dataclass
class Table:
    rows: list[dict[str, Any]] = field(default_factory=list)
    per_replica_capacity_rps: float = 0.0
    balancer_capacity_rps: float = 0.0
    assumptions: tuple[str, ...] = ASSUMPTIONS


def table(fit: EncoderFit, costs: RayCosts, pricing: Pricing, *, utilisation: float = 0.7,
          counts: Sequence[int] = REPLICA_COUNTS, sim: Sim | None = None,
          with_random: bool = True) -> Table:
    """One row per replica count: capacity (replicas x one replica's, bounded by the
    balancer), and at ``utilisation`` x that capacity: throughput, p50 / p99 (leastconn;
    random split beside it), cores, memory, cost."""
    one = fit.capacity_rps()
    balancer = costs.balancer_capacity_rps()
    out = Table(per_replica_capacity_rps=one, balancer_capacity_rps=balancer)
    rand = predict(fit, 1, utilisation * one, balance="random", sim=sim) if with_random else None
    for n in counts:
        capacity = n * one
        rate = utilisation * min(capacity, balancer)
        fig = predict(fit, n, rate, sim=sim)
        row: dict[str, Any] = {
            "replicas": n, "capacity_rps": min(capacity, balancer),
            "balancer_bound": capacity > balancer, "rate": rate,
            "throughput_rps": fig.throughput_rps, "p50_ms": fig.latency_ms.get("p50"),
            "p99_ms": fig.latency_ms.get("p99"), "refused_share": fig.refused_share,
            "mean_batch": fig.mean_batch,
            "p99_ms_random_split": rand.latency_ms.get("p99") if rand else None,
            **resources(costs, n, rate, pricing)}
        out.rows.append(row)
    return out


def fit_as_dict(fit: EncoderFit) -> dict[str, Any]:
    """Everything ``fit_from_dict`` needs (``EncoderFit.as_dict`` leaves out the samples)."""
    return {"base_ms": fit.base_ms, "per_item_ms": fit.per_item_ms, "inline_ms": fit.inline_ms,
            "overhead_ms": fit.overhead_ms, "outside_ms": fit.outside_ms,
            "spread": [round(float(x), 5) for x in fit.spread],
            "outside": [round(float(x), 4) for x in fit.outside],
            "max_batch": fit.max_batch, "queue_depth": fit.queue_depth,
            "reject_ms": fit.reject_ms, "outside_load_ms": fit.outside_load_ms,
            "anchor": fit.anchor}


def fit_from_dict(d: dict[str, Any]) -> EncoderFit:
    return EncoderFit(base_ms=d["base_ms"], per_item_ms=d["per_item_ms"],
                      inline_ms=d["inline_ms"], overhead_ms=d["overhead_ms"],
                      outside_ms=d["outside_ms"], spread=np.asarray(d["spread"]),
                      max_batch=int(d["max_batch"]), queue_depth=int(d["queue_depth"]),
                      anchor=d.get("anchor", ""), capacity_runs=(),
                      outside=np.asarray(d["outside"]), reject_ms=d.get("reject_ms", 0.0),
                      outside_load_ms=d.get("outside_load_ms", 0.0))


def render(t: Table, pricing: Pricing) -> str:
    lines = [f"one replica: {t.per_replica_capacity_rps:.1f} req/s at capacity; balancer "
             f"(HAProxy): {t.balancer_capacity_rps:.0f} req/s",
             f"{'replicas':>8} {'capacity':>9} {'rate':>9} {'p50 ms':>7} {'p99 ms':>7} "
             f"{'p99 rnd':>7} {'cores':>6} {'mem GB':>7} {'$/1M':>8}"]
    for r in t.rows:
        per_1m = r.get("per_1m_requests")
        lines.append(f"{r['replicas']:>8} {r['capacity_rps']:>9.0f} {r['rate']:>9.0f} "
                     f"{r['p50_ms'] or 0:>7.1f} {r['p99_ms'] or 0:>7.1f} "
                     f"{r['p99_ms_random_split'] or 0:>7.1f} {r['cores']:>6.1f} "
                     f"{r['memory_mb'] / 1024:>7.1f} "
                     f"{'-' if per_1m is None else f'{per_1m:.4f}':>8}"
                     + ("  balancer-bound" if r["balancer_bound"] else ""))
    lines.append(f"(price per core-hour: {pricing.price_per_core_hour}; cores per replica "
                 f"{pricing.cores_per_replica}, per node {pricing.cores_per_node})")
    return "\n".join(lines + [f"assumption: {a}" for a in t.assumptions])


def from_record(doc: dict[str, Any]) -> tuple[EncoderFit, RayCosts]:
    """The single-process fit and Ray's costs recorded by ``benchmarks/ray_scaleout.py``."""
    inputs = doc["model_inputs"]
    return fit_from_dict(inputs["single_fit"]), RayCosts(**inputs["ray_costs"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sokuji plan --ray", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("record", help="a benchmarks/ray_scaleout.py JSON (its model_inputs)")
    p.add_argument("--utilisation", type=float, default=0.7,
                   help="the rate, as a fraction of the replicas' capacity (default 0.7)")
    p.add_argument("--price-per-core-hour", type=float)
    p.add_argument("--cores-per-replica", type=int, default=1)
    p.add_argument("--cores-per-node", type=int, default=16)
    p.add_argument("--replicas", type=int, nargs="+", default=list(REPLICA_COUNTS))
    p.add_argument("--requests", type=int, default=Sim.requests,
                   help="simulated requests per row (accuracy of p99 against time)")
    p.add_argument("--json", dest="json_out", help="write the table here")
    args = p.parse_args(argv)
    if not 0 < args.utilisation < 1:
        p.error("--utilisation must be between 0 and 1")
    try:
        with open(args.record, encoding="utf-8") as f:
            single, costs = from_record(json.load(f))
    except OSError as exc:
        print(f"{p.prog}: cannot read {args.record}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError) as exc:
        print(f"{p.prog}: {args.record} is not a benchmarks/ray_scaleout.py record "
              f"(model_inputs): {exc!r}", file=sys.stderr)
        return 2
    pricing = Pricing(args.price_per_core_hour, args.cores_per_replica, args.cores_per_node)
    t = table(ray_replica(single, costs), costs, pricing, utilisation=args.utilisation,
              counts=args.replicas, sim=Sim(requests=args.requests))
    print(render(t, pricing))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"rows": t.rows, "per_replica_capacity_rps": t.per_replica_capacity_rps,
                       "balancer_capacity_rps": t.balancer_capacity_rps,
                       "assumptions": list(t.assumptions)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
