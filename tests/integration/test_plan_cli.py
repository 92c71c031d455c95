"""``sokuji plan`` end to end: a real server (the synthetic runtime: a batch of b takes
4 + 1 x b ms), real ``sokuji bench`` runs against it, then the planner's CLI on their JSON
with the server's own ``/config`` and ``/stats``: a plan, its JSON and HTML, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

CONFIG = """
[jobs]
enabled = false
[[models]]
name = "synth"
runtime = "synthetic"
cache = false
max_batch_size = 8
max_queue_depth = 64
options = {base_ms = 4.0, per_item_ms = 1.0}
"""


def sokuji(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sokuji", *args], capture_output=True,
                          text=True, check=check, timeout=120)


@pytest.fixture(scope="module")
def benched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """The server's URL and two bench results: a lone request, and a load past capacity."""
    tmp = tmp_path_factory.mktemp("plan")
    with sokuji_server(CONFIG) as url:
        paths = []
        for name, load, seconds in (("c1", "1", "2"), ("c24", "24", "3")):
            out = tmp / f"{name}.json"
            sokuji("bench", url, "--model", "synth", "--concurrency", load, "--duration",
                   seconds, "--warmup", "0.5s", "--quiet", "--out", str(out))
            paths.append(str(out))
        yield url, paths


def test_plan_from_real_bench_results(benched: tuple[str, list[str]], tmp_path: Path) -> None:
    url, paths = benched
    out, page = tmp_path / "plan.json", tmp_path / "plan.html"
    done = sokuji("plan", "--from", *paths, "--stats", url, "--rate", "400", "--slo",
                  "p99=100ms", "--price-per-hour", "1.5", "--predict", "100", "--json",
                  str(out), "--html", str(page), "--sim-seconds", "10", "--seeds", "2")
    assert "replicas" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "sokuji.plan/1" and doc["kind"] == "encoder"
    fit = doc["fit"]
    # the batcher's settings came from the server, not from defaults
    assert (fit["max_batch_size"], fit["queue_depth"]) == (8, 64)
    assert not [n for n in fit["notes"] if "not given" in n]
    # A lone request: at least the model's 4 + 1 ms of sleep; at most what the client saw of
    # lone requests in the same run (its p99: the client's side comes on top of the server's).
    lone = json.loads(Path(paths[0]).read_text())["summary"]["latency_ms"]
    assert 5.0 <= fit["inline_ms"] <= lone["p99"], (fit["inline_ms"], lone)
    measured = json.loads(Path(paths[1]).read_text())["summary"]["throughput_rps"]
    # the fit reproduces the capacity run it was fitted to
    check = next(c for c in doc["fit_check"] if "c=24" in c["run"])
    assert check["simulated"]["throughput_rps"] == pytest.approx(measured, rel=0.1)
    plan = doc["plan"]
    assert plan["replicas"] >= 1 and plan["cores"] == plan["replicas"]
    assert plan["replicas"] * plan["per_replica_max_rate"] >= 400
    assert plan["predicted"]["latency_ms"]["p99"] <= 100
    assert plan["cost"]["per_1m_requests"] == pytest.approx(
        plan["replicas"] * 1.5 / (400 * 3600) * 1e6)
    assert doc["predictions"][0]["rate"] == 100
    html = page.read_text()
    assert html.count("data:image/png;base64,") == 2 and "sokuji plan" in html

    unreachable = sokuji("plan", "--from", *paths, "--stats", url, "--rate", "10", "--slo",
                         "p99=1ms", "--quiet", "--sim-seconds", "5", "--seeds", "1",
                         check=False)
    assert unreachable.returncode == 3 and "own latency" in unreachable.stderr
