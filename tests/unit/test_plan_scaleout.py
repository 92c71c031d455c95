"""The 1-100 replica model (``sokuji/plan/scaleout.py``): its balancer simulation against the
single replica and queueing theory, its arithmetic (Ray's costs on a fit, cores, memory,
cost linear in replicas), and its round trip through a recorded benchmark."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from sokuji.bench.schedule import Arrivals, intended_times
from sokuji.plan import scaleout, simulate
from sokuji.plan.fit import EncoderFit

SMALL = scaleout.Sim(requests=12_000, seeds=2)


def _fit(service_ms: float = 10.0, spread: np.ndarray | None = None) -> EncoderFit:
    return EncoderFit(base_ms=0.0, per_item_ms=service_ms, inline_ms=service_ms,
                      overhead_ms=1.0, outside_ms=0.5,
                      spread=np.ones(1) if spread is None else spread, max_batch=1,
                      queue_depth=10_000, anchor="test", capacity_runs=(),
                      outside=np.full(1, 0.5))


def _exponential() -> np.ndarray:
    return np.random.default_rng(7).exponential(1.0, 50_000)


def test_one_replica_behind_leastconn_is_the_single_replica() -> None:
    service = simulate.Service.linear(2.0, 1.0, 8, spread=_exponential(), inline_ms=2.5)
    arrivals = intended_times(400.0, Arrivals.POISSON, 5, duration_s=10.0) + 1e-3
    alone = simulate.open_loop(arrivals, service, max_batch=8, outside_ms=0.7, seed=3)
    behind = scaleout.leastconn_loop(arrivals, 1, service, max_batch=8, outside_ms=0.7, seed=3)
    np.testing.assert_allclose(behind.latency_s, alone.latency_s, rtol=1e-12)
    assert behind.inline == alone.inline


def test_random_split_n_replicas_at_n_lambda_is_one_replica_at_lambda() -> None:
    fit = _fit(10.0, _exponential())
    one = scaleout.predict(fit, 1, 60.0, balance="random", sim=SMALL)
    many = scaleout.predict(fit, 8, 8 * 60.0, balance="random", sim=SMALL)
    assert many.latency_ms["p99"] == pytest.approx(one.latency_ms["p99"], rel=1e-9)
    assert many.throughput_rps == pytest.approx(8 * one.throughput_rps, rel=1e-9)


def test_leastconn_pools_the_replicas() -> None:
    """Exponential service at rho 0.75: an even random split leaves each replica an M/M/1
    queue; leastconn over 4 replicas waits far less, and takes the whole rate."""
    fit = _fit(10.0, _exponential())
    split = scaleout.predict(fit, 4, 300.0, balance="random", sim=SMALL)
    four = scaleout.predict(fit, 4, 300.0, sim=SMALL)
    assert four.throughput_rps == pytest.approx(300.0, rel=0.05)
    assert four.latency_ms["p99"] < 0.6 * split.latency_ms["p99"]
    # never better than no waiting at all: the service time's own p99 (exponential)
    assert four.latency_ms["p99"] > 10.0 * math.log(100) * 0.85


def test_ray_costs_on_the_fit() -> None:
    costs = scaleout.RayCosts(replica_cpu_ms=1.2, hop_ms=0.8, balancer_cpu_ms=0.25,
                              replica_mb=400.0)
    single = _fit(5.0)
    ray = scaleout.ray_replica(single, costs, colocated_cpu_ms=0.3)
    assert ray.service().mean_ms[1] == pytest.approx(5.0 + 1.5)
    assert ray.service().inline_ms == pytest.approx(5.0 + 1.5)
    assert float(ray.outside.mean()) == pytest.approx(0.5 + 0.8)
    assert ray.capacity_rps() == pytest.approx(1e3 / 6.5)
    assert costs.balancer_capacity_rps() == pytest.approx(4 * 1e3 / 0.25)


def test_cores_memory_and_cost_are_linear_in_replicas() -> None:
    costs = scaleout.RayCosts(replica_cpu_ms=1.0, hop_ms=1.0, balancer_cpu_ms=0.5,
                              replica_mb=300.0, cluster_mb=800.0, node_mb=300.0,
                              background_cores=0.1)
    pricing = scaleout.Pricing(price_per_core_hour=0.05, cores_per_replica=2, cores_per_node=8)
    one = scaleout.resources(costs, 1, 100.0, pricing)
    ten = scaleout.resources(costs, 10, 1000.0, pricing)
    assert one["cores"] == pytest.approx(2 + 0.05 + 0.1)
    assert ten["cores"] == pytest.approx(20 + 0.5 + 0.1)
    assert ten["nodes"] == 3
    assert ten["memory_mb"] == pytest.approx(800 + 2 * 300 + 10 * 300)
    assert ten["per_hour"] == pytest.approx(ten["cores"] * 0.05)
    # per 1M requests: the replicas' share is the same at 10x the replicas and 10x the rate
    per_replica_share = [r["per_1m_requests"] - 0.1 * 0.05 / (rate * 3600) * 1e6
                         for r, rate in ((one, 100.0), (ten, 1000.0))]
    assert per_replica_share[0] == pytest.approx(per_replica_share[1], rel=1e-9)


def test_table_and_record_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    fit = _fit(8.0, _exponential())
    costs = scaleout.RayCosts(replica_cpu_ms=1.0, hop_ms=1.0, balancer_cpu_ms=2.0,
                              replica_mb=300.0)
    record = tmp_path / "rec.json"
    record.write_text(json.dumps({"model_inputs": {
        "single_fit": scaleout.fit_as_dict(fit), "ray_costs": vars(costs)}}))
    out = tmp_path / "table.json"
    assert scaleout.main([str(record), "--replicas", "1", "4", "1000",
                          "--price-per-core-hour", "0.04", "--requests", "8000", "--json",
                          str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["replicas"] for r in rows] == [1, 4, 1000]
    assert not rows[1]["balancer_bound"] and rows[2]["balancer_bound"]
    assert rows[2]["capacity_rps"] == pytest.approx(2000.0)
    assert rows[1]["p99_ms"] <= rows[0]["p99_ms"]
    assert "balancer-bound" in capsys.readouterr().out


def test_a_bad_record_is_refused_with_exit_2(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rounds": []}))
    assert scaleout.main([str(bad)]) == 2
    assert scaleout.main([str(tmp_path / "missing.json")]) == 2
    assert "model_inputs" in capsys.readouterr().err
