from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sokuji.bench import dataset, stats
from sokuji.bench.engine import Record, RunResult, parse_server_timing
from sokuji.bench.runner import main_bench
from sokuji.bench.schedule import Arrivals, intended_times
from sokuji.bench.targets import StreamParse, Target, TargetKind

# --- schedules ------------------------------------------------------------------------------

@pytest.mark.parametrize("arrivals", list(Arrivals))
def test_the_same_seed_gives_the_same_schedule(arrivals: Arrivals) -> None:
    a = intended_times(100, arrivals, seed=7, duration_s=5, burstiness=0.5)
    b = intended_times(100, arrivals, seed=7, duration_s=5, burstiness=0.5)
    np.testing.assert_array_equal(a, b)
    assert np.all(np.diff(a) >= 0) and a[0] == 0 and a[-1] < 5
    if arrivals is not Arrivals.CONSTANT:
        assert not np.array_equal(a, intended_times(100, arrivals, seed=8, duration_s=5,
                                                    burstiness=0.5))


def test_schedules_have_the_asked_rate_and_burstiness() -> None:
    const = intended_times(50, Arrivals.CONSTANT, seed=0, count=100)
    assert np.allclose(np.diff(const), 0.02) and len(const) == 100
    poisson = np.diff(intended_times(200, Arrivals.POISSON, seed=1, duration_s=100))
    assert poisson.mean() == pytest.approx(1 / 200, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # CV of exponential
    bursty = np.diff(intended_times(200, Arrivals.GAMMA, seed=1, duration_s=100,
                                    burstiness=0.25))
    assert bursty.mean() == pytest.approx(1 / 200, rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.15)  # 1/shape
    with pytest.raises(ValueError):
        intended_times(0, Arrivals.POISSON, seed=0, count=3)


# --- statistics -----------------------------------------------------------------------------

def test_hdr_percentiles_agree_with_exact_ones() -> None:
    rng = np.random.default_rng(3)
    values = rng.lognormal(np.log(0.02), 0.5, 20_000)
    summary = stats.latency_summary(values.tolist())
    assert summary is not None
    for p in (50, 90, 99, 99.9):
        exact = np.percentile(values, p) * 1e3
        assert summary["p" + f"{p:g}".replace(".", "_")] == pytest.approx(exact, rel=2e-3)
    assert summary["max"] == pytest.approx(values.max() * 1e3, rel=1e-3)
    assert stats.latency_summary([]) is None


def run_of(latencies_s: list[float], stages: list[dict[str, float]] | None = None,
           errors: dict[int, str] | None = None, warm: int = 0) -> RunResult:
    records = []
    for i, lat in enumerate(latencies_s):
        rec = Record(intended_s=i * 0.01, sent_s=i * 0.01, done_s=i * 0.01 + lat,
                     status=200, warmup=i < warm)
        if stages:
            rec.stages_ms = stages[i]
        if errors and i in errors:
            rec.error, rec.status = errors[i], 503
        records.append(rec)
    return RunResult(records, 0.0, 2.0, 0.1, "closed")


def test_tail_attribution_names_where_the_slowest_requests_spent_their_time() -> None:
    lats = [0.010] * 99 + [0.100]
    stages = [{"queue": 0.5, "infer": 9.0, "total": 9.5}] * 99 + \
        [{"queue": 90.0, "infer": 9.0, "total": 99.0}]
    s = stats.summarize(run_of(lats, stages))
    st = s["stages"]
    assert st["tail_requests"] == 1
    assert st["tail_mean_ms"]["queue"] == 90.0
    assert st["tail_share"]["queue"] == pytest.approx(0.9, abs=0.01)
    assert st["mean_share"]["infer"] > 0.5


def test_summary_excludes_warmup_and_counts_errors() -> None:
    s = stats.summarize(run_of([0.01] * 10, errors={5: "http_503"}, warm=3))
    assert s["requests"] == {"sent": 7, "ok": 6, "errors": {"http_503": 1},
                             "error_rate": 1 / 7, "warmup_excluded": 3}
    assert s["latency_ms"]["count"] == 6


def open_run(lags_s: list[float]) -> RunResult:
    """100 req/s for len(lags_s) requests, each sent ``lags_s[i]`` after its time."""
    recs = [Record(intended_s=i / 100, sent_s=i / 100 + lag, done_s=i / 100 + lag + 0.01,
                   status=200) for i, lag in enumerate(lags_s)]
    return RunResult(recs, 0.0, len(lags_s) / 100 + 0.1, 0.1, "open")


def test_late_sends_warn_but_only_a_lasting_shortfall_means_the_client_cannot_keep_up(
        ) -> None:
    jitter = [0.0] * 300
    jitter[100:106] = [0.030, 0.025, 0.020, 0.015, 0.010, 0.001]  # late, then caught up
    client = stats.summarize(open_run(jitter))["client"]
    assert client["behind_schedule"] and not client["cannot_keep_up"]
    assert client["send_rate_ratio"] == pytest.approx(1.0)
    falling = [i * 0.004 for i in range(300)]  # 1.4x slower than asked, for good
    client = stats.summarize(open_run(falling))["client"]
    assert client["cannot_keep_up"] and client["send_rate_ratio"] == pytest.approx(1 / 1.4)
    on_time = stats.summarize(open_run([0.0001] * 300))["client"]
    assert not on_time["behind_schedule"] and not on_time["cannot_keep_up"]


@pytest.mark.parametrize(("text", "metric", "stat", "limit"), [
    ("p99=100ms", "latency_ms", "p99", 100.0),
    ("p99.9=1s", "latency_ms", "p99_9", 1000.0),
    ("ttft_p95=500ms", "ttft_ms", "p95", 500.0),
    ("itl_p99=50ms", "itl_ms", "p99", 50.0),
    ("mean=250us", "latency_ms", "mean", 0.25),
    ("error_rate=1%", "error_rate", "rate", 0.01),
])
def test_slo_parsing(text: str, metric: str, stat: str, limit: float) -> None:
    slo = stats.parse_slo(text)
    assert (slo.metric, slo.stat, slo.limit) == (metric, stat, pytest.approx(limit))


def test_slo_verdicts_and_bad_slos() -> None:
    s = stats.summarize(run_of([0.010] * 100))
    v = stats.verdicts([stats.parse_slo("p99=20ms"), stats.parse_slo("p50=5ms"),
                        stats.parse_slo("ttft_p99=1s")], s)
    assert [x["ok"] for x in v] == [True, False, False]  # no TTFT measured: not met
    with pytest.raises(ValueError, match="not understood"):
        stats.parse_slo("p99<100ms")


def test_cost_per_thousand_requests_and_per_million_tokens() -> None:
    c = stats.cost({"throughput_rps": 100.0, "output_tokens_per_s": 1000.0}, 3.6)
    assert c["per_1k_requests"] == pytest.approx(0.01)
    assert c["per_1m_output_tokens"] == pytest.approx(1.0)


# --- targets, streams, datasets -------------------------------------------------------------

def test_target_bodies() -> None:
    item = dataset.Item(text='say "hi"')
    v2 = json.loads(Target(TargetKind.V2, "http://h:1").body(item))
    assert v2["inputs"][0]["data"] == ['say "hi"']
    t = Target(TargetKind.OPENAI_CHAT, "http://h:1/", model="m", max_tokens=5)
    chat = json.loads(t.body(item))
    assert t.url == "http://h:1/v1/chat/completions" and chat["stream"] is True
    assert chat["messages"] == [{"role": "user", "content": 'say "hi"'}]
    http = Target(TargetKind.HTTP, "http://h:1", path="/predict",
                  body_template='{"q": "{text}", "k": 3}')
    assert json.loads(http.body(item)) == {"q": 'say "hi"', "k": 3}
    assert http.url == "http://h:1/predict"


def test_stream_parser_counts_tokens_across_split_chunks() -> None:
    events = b"".join(
        b"data: " + json.dumps({"choices": [{"delta": {"content": w}}]}).encode() + b"\n\n"
        for w in ("Hel", "lo", "", " world"))
    events += b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n'
    parser = StreamParse()
    seen = sum(parser.feed(events[i:i + 7]) for i in range(0, len(events), 7))
    assert seen == 3 and parser.done and parser.output_tokens == 3


def test_server_timing_parse() -> None:
    assert parse_server_timing("queue;dur=1.5, infer;desc=\"x\";dur=2, miss") == \
        {"queue": 1.5, "infer": 2.0}


def test_datasets() -> None:
    for name in dataset.GENERATED:
        assert len(dataset.load(name)) == 400
    assert len(dataset.load("passages")) == 8
    sampler_a = dataset.Sampler(dataset.load("mixed"), seed=4)
    sampler_b = dataset.Sampler(dataset.load("mixed"), seed=4)
    assert [sampler_a.next() for _ in range(50)] == [sampler_b.next() for _ in range(50)]
    with pytest.raises(ValueError, match="no such file"):
        dataset.load("nonexistent")


def test_chat_dataset_lines(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hi"}]}) + "\n")
    (item,) = dataset.load(str(path))
    assert item.text == "hi" and len(item.messages) == 2


# --- compare --------------------------------------------------------------------------------

def result(rps: float, p99: float) -> dict[str, Any]:
    return {"schema": "sokuji.bench/1", "summary": {
        "throughput_rps": rps, "latency_ms": {"p50": p99 / 2, "p99": p99, "p99_9": p99},
        "requests": {"error_rate": 0.0}}}


def test_compare_exits_non_zero_on_a_regression(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(result(100, 20)))
    b.write_text(json.dumps(result(97, 21)))   # within 10%
    c.write_text(json.dumps(result(100, 30)))  # p99 +50%
    assert main_bench(["bench", "compare", str(a), str(b)]) == 0
    assert main_bench(["bench", "compare", str(a), str(c)]) == 1
    assert main_bench(["bench", "compare", str(a), str(c), "--threshold", "60%"]) == 0
    assert main_bench(["bench", "compare", str(a), str(tmp_path / "missing.json")]) == 2


def test_bench_does_not_import_the_server() -> None:
    code = ("import sys, sokuji.bench.runner, sokuji.bench.report\n"
            "print(sorted(m for m in sys.modules if m.startswith('sokuji.server') or m in "
            "('starlette', 'onnxruntime', 'uvicorn', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
