"""Canary routers and shadow traffic against a real ``sokuji serve`` process under concurrent
open-loop load (aiohttp, requests sent on a fixed schedule whether or not earlier ones have
answered, as real clients do).

- A canary that starts failing every request mid-load (synthetic ``degrade_after_s``,
  ``degrade_error_rate = 1.0``) at 25% is rolled back within one window of the moment it
  degraded, read from the server's own log (the model's load line + ``degrade_after_s``, and
  the controller's WARNING line); no client sees an error (stable answers the canary's failed
  requests); the weight is 0 afterwards and stable answers everything. The same at 50% and
  100 req/s, with many healthy canary requests in the window before it degrades: the requests
  its open breaker skips count against it (they once did not, and such a canary passed).
- A canary that gets 200 ms slower rolls back on the latency test (against live stable's
  p99), again within one window.
- Shadow traffic on a rules router: the client always gets the primary's answer; copies are
  counted by outcome (a shadow that fails on some inputs: ``outcome="error"``); a shadow
  classifier whose prototypes have two labels swapped (a bad retrain) disagrees exactly on the
  requests the primary labels with one of them.
- A canary with too little traffic holds: no rollback, its weight unchanged, hold events.

Times come from the server's log (ms resolution) and the client's wall clock on the same
machine; the assertions compare them with ``window_s`` (the property under test), never
with an absolute latency.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import CACHE_DIR
from tests.integration.serving import free_port, wait_ready

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parent.parent / "data" / "routing"
WINDOW_S = 10.0
MIN_FAILURES = 3
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class Server:
    url: str
    log: Path

    def metric(self, line_start: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(line_start):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log_time(self, needle: str) -> float | None:
        """Wall-clock time (epoch s) of the first log line containing ``needle``."""
        for line in self.log.read_text().splitlines():
            m = LOG_TIME.match(line)
            if m and needle in line:
                return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return None

    def log_line(self, needle: str) -> str:
        return next((line for line in self.log.read_text().splitlines() if needle in line), "")


@contextmanager
def serve(body: str, cache_dir: Path | None = None) -> Iterator[Server]:
    """``sokuji serve`` with ``body`` (TOML), its log (level info) kept in a file."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "sokuji.toml"
        log = Path(tmp) / "server.log"
        config.write_text(f'port = {port}\ngrpc_port = 0\nlog_level = "info"\n'
                          f'cache_dir = "{cache_dir or tmp}"\n{body}')
        with log.open("wb") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "sokuji", "serve", "--config",
                                     str(config)], stdout=subprocess.DEVNULL, stderr=sink)
            try:
                try:
                    wait_ready(proc, f"http://127.0.0.1:{port}/v2/health/ready", timeout_s=120)
                except RuntimeError as exc:
                    raise RuntimeError(f"{exc}: {log.read_text()[-2000:]}") from None
                yield Server(f"http://127.0.0.1:{port}", log)
            finally:
                if proc.poll() is None:
                    proc.terminate()
                proc.wait(timeout=20)


@dataclass
class Reply:
    sent: float
    """Wall clock (epoch s) when the request was sent."""
    done: float
    status: int
    served_by: str
    route: str
    """The ``route`` entry of Server-Timing: who answered, why, failed attempts."""
    output: list[float] | None


async def open_loop(url: str, model: str, rate: float, seconds: float,
                    texts: list[str] | None = None) -> list[Reply]:
    """Requests at a fixed ``rate`` for ``seconds``, each sent on schedule (not waiting for
    earlier ones); request k carries ``texts[k % len(texts)]`` (default: ``"request k"``)."""
    import aiohttp

    replies: list[Reply] = []
    endpoint = f"{url}/v2/models/{model}/infer"

    async def one(session: aiohttp.ClientSession, k: int) -> None:
        text = texts[k % len(texts)] if texts else f"request {k}"
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                            "data": [text]}]}
        sent = time.time()
        try:
            async with session.post(endpoint, json=body) as r:
                data = await r.read()
                timing = r.headers.get("server-timing", "")
                route = re.search(r'route;[^,]*desc="([^"]*)"', timing)
                output = json.loads(data)["outputs"][0]["data"] if r.status == 200 else None
                replies.append(Reply(sent, time.time(), r.status,
                                     r.headers.get("x-sokuji-served-by", ""),
                                     route.group(1) if route else "", output))
        except aiohttp.ClientError:
            replies.append(Reply(sent, time.time(), 0, "", "", None))

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        for k in range(int(rate * seconds)):
            delay = start + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, k)))
        await asyncio.gather(*tasks)
    replies.sort(key=lambda r: r.sent)
    return replies


def toml_table(values: dict[str, object]) -> str:
    """An inline TOML table of strings, numbers and lists of numbers."""
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in values.items()) + " }"


def canary_config(v2: str, **canary: object) -> str:
    opts = {"stable": "v1", "canary": "v2", "steps": [25], "window_s": WINDOW_S,
            "min_samples": 20, "min_failures": MIN_FAILURES, "alpha": 0.001, "seed": 11,
            **canary}
    return f"""
[[models]]
name = "v1"
runtime = "synthetic"
cache = false
inline_max_ms = 0
options = {{ base_ms = 1.0, seed = 1 }}
[[models]]
name = "v2"
runtime = "synthetic"
cache = false
inline_max_ms = 0
options = {{ base_ms = 1.0, seed = 2, {v2} }}
[[models]]
name = "r"
runtime = "router"
cache = false
[models.options]
kind = "canary"
canary = {toml_table(opts)}
"""


def _rolls_back_within_a_window(server: Server, replies: list[Reply], degrade_after_s: float,
                                reason: str, window_s: float = WINDOW_S) -> float:
    """Checks common to a degrading canary; returns the time from degrading to rollback."""
    loaded = server.log_time("model v2 loaded")
    assert loaded is not None
    degraded = loaded + degrade_after_s
    assert server.log_time("canary r promoted") is None, server.log_line("promoted")
    rolled = server.log_time("canary r rolled back")
    assert rolled is not None, server.log.read_text()[-3000:]
    assert f"{reason}:" in server.log_line("canary r rolled back")
    assert server.metric(f'sokuji_canary_rollbacks_total{{reason="{reason}",router="r"}}') == 1
    assert server.metric('sokuji_canary_weight{router="r"}') == 0
    # The canary served traffic before it degraded: the rollback happened mid-load.
    assert any(r.served_by == "v2" and r.done < degraded for r in replies)
    assert 0 < rolled - degraded <= window_s, (rolled - degraded, server.log_line("rolled"))
    # After the rollback (and the requests then in flight) stable answers everything.
    after = [r for r in replies if r.sent > rolled + 0.05]
    assert after and all(r.served_by == "v1" and "v2" not in r.route for r in after)
    return rolled - degraded


@pytest.mark.parametrize(("weight", "rate", "window_s"), [
    # 50% at 100 req/s: many healthy canary requests in the window before it degrades, the
    # hard case (25% at 50 req/s passes too: benchmarks/canary.py measures both)
    (50, 100, 6.0),
])
def test_an_error_degrading_canary_rolls_back_within_one_window(
        weight: int, rate: int, window_s: float) -> None:
    body = canary_config("degrade_after_s = 3.0, degrade_error_rate = 1.0", steps=[weight],
                         window_s=window_s)
    with serve(body) as server:
        replies = asyncio.run(open_loop(server.url, "r", rate=rate, seconds=9))
        took = _rolls_back_within_a_window(server, replies, 3.0, "errors", window_s)
        rolled = server.log_time("canary r rolled back")
        assert rolled is not None
        failed = [r for r in replies if "v2 error" in r.route]
        # Each failed canary request was answered by stable: no client saw an error.
        assert len(failed) >= MIN_FAILURES and all(r.status == 200 and r.served_by == "v1"
                                                   for r in failed)
        errors = [r for r in replies if r.status != 200]
        in_flight = sum(1 for r in replies if r.sent <= rolled < r.done)
        assert len(errors) <= MIN_FAILURES + in_flight, errors[:5]
        assert not errors
        # The routing counters agree with what the clients saw.
        route = 'sokuji_route_requests_total{{reason="{}",router="r",target="{}"}}'
        assert server.metric(route.format("canary", "v2")) == sum(
            r.served_by == "v2" for r in replies)
        assert server.metric(route.format("fallback:error", "v1")) == len(failed)
        assert server.metric("sokuji_route_requests_total{") == len(replies)
        print(f"rollback {took:.2f} s after the canary degraded; {len(failed)} canary "
              f"failures, all answered by stable; {len(replies)} requests")


def test_a_slow_canary_rolls_back_on_the_latency_test() -> None:
    body = canary_config("degrade_after_s = 3.0, degrade_extra_ms = 200.0")
    with serve(body) as server:
        replies = asyncio.run(open_loop(server.url, "r", rate=50, seconds=7))
        took = _rolls_back_within_a_window(server, replies, 3.0, "latency")
        assert all(r.status == 200 for r in replies)
        assert "slower than" in server.log_line("canary r rolled back")
        print(f"rollback {took:.2f} s after the canary slowed down")


def test_shadow_copies_never_reach_the_client_and_are_counted() -> None:
    body = """
[[models]]
name = "v1"
runtime = "synthetic"
cache = false
options = { base_ms = 1.0 }
[[models]]
name = "v2"
runtime = "synthetic"
cache = false
options = { base_ms = 1.0, fail_on = "boom" }
[[models]]
name = "r"
runtime = "router"
cache = false
options = { kind = "rules", default = "v1", shadow = { target = "v2", fraction = 1.0 } }
"""
    texts = ["boom" if k % 10 == 3 else f"text number {k}" for k in range(10)]
    with serve(body) as server:
        replies = asyncio.run(open_loop(server.url, "r", rate=50, seconds=4, texts=texts))
        n = len(replies)
        booms = sum(1 for k in range(n) if texts[k % 10] == "boom")
        assert all(r.status == 200 and r.served_by == "v1" for r in replies)
        for k, r in enumerate(replies):  # v1's own answer: the text's length
            assert r.output == [float(len(texts[k % 10]))]
        label = '{{outcome="{}",router="r",target="v2"}}'
        counted = _wait_for(lambda: sum(server.metric(f"sokuji_shadow_requests_total"
                                                      f"{label.format(o)}")
                                        for o in ("ok", "error", "dropped")), n)
        assert counted == n
        dropped = server.metric(f"sokuji_shadow_requests_total{label.format('dropped')}")
        errors = server.metric(f"sokuji_shadow_requests_total{label.format('error')}")
        ok = server.metric(f"sokuji_shadow_requests_total{label.format('ok')}")
        assert dropped == 0 and errors == booms and ok == n - booms
        # The synthetic target's answer is a function of the text: copies agree.
        assert server.metric("sokuji_shadow_disagreements_total") == 0


def test_a_shadow_classifier_that_disagrees_is_counted() -> None:
    """The shadow is the same classifier with the prototypes of two labels swapped (a bad
    retrain): it disagrees exactly on the requests the primary labels with one of those."""
    from sokuji.weights import minilm

    minilm.ensure_onnx(CACHE_DIR)  # the served process must not export it under its timeout
    rows = [json.loads(line) for line in (DATA / "prototypes.jsonl").read_text().splitlines()]
    swap = {"balance": "weather", "weather": "balance"}
    labels = sorted({row["label"] for row in rows})
    queries = [json.loads(line)["text"] for line in
               (DATA / "queries.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        swapped = Path(tmp) / "swapped.jsonl"
        swapped.write_text("".join(json.dumps({"text": row["text"], "label": swap.get(
            row["label"], row["label"])}) + "\n" for row in rows))
        body = f"""
[[models]]
name = "intent"
runtime = "classifier"
cache = false
options = {{ prototypes = "{DATA / 'prototypes.jsonl'}", intra_op_threads = 1 }}
[[models]]
name = "intent-v2"
runtime = "classifier"
cache = false
options = {{ prototypes = "{swapped}", intra_op_threads = 1 }}
[[models]]
name = "r"
runtime = "router"
cache = false
options = {{ kind = "rules", default = "intent", shadow = {{ target = "intent-v2" }} }}
"""
        with serve(body, cache_dir=CACHE_DIR) as server:
            replies = asyncio.run(open_loop(server.url, "r", rate=20, seconds=2,
                                            texts=queries))
            assert all(r.status == 200 and r.served_by == "intent" for r in replies)
            predicted = []
            for r in replies:
                assert r.output is not None
                predicted.append(labels[max(range(len(labels)), key=r.output.__getitem__)])
            expected = sum(1 for p in predicted if p in swap)
            assert 0 < expected < len(replies)
            label = '{outcome="ok",router="r",target="intent-v2"}'
            assert _wait_for(lambda: server.metric(f"sokuji_shadow_requests_total{label}"),
                             len(replies)) == len(replies)
            assert server.metric("sokuji_shadow_disagreements_total"
                                 '{router="r",target="intent-v2"}') == expected


def test_an_idle_canary_holds_and_never_fails() -> None:
    body = canary_config("error_rate = 0.0", steps=[25, 100], window_s=1.0, min_samples=50,
                         max_hold_windows=1, on_no_traffic="hold")
    with serve(body) as server:
        replies = asyncio.run(open_loop(server.url, "r", rate=4, seconds=3.5))
        assert all(r.status == 200 for r in replies)
        assert any(r.served_by == "v2" for r in replies)  # it had some traffic, too little
        assert server.metric('sokuji_canary_rollbacks_total{') == 0
        assert server.metric('sokuji_canary_weight{router="r"}') == 25
        assert server.metric('sokuji_canary_events_total{event="hold",router="r"}') >= 1
        assert server.metric('sokuji_canary_events_total{event="step",router="r"}') == 0
        assert "holds at 25%" in server.log_line("canary r holds")


def _wait_for(read: object, expected: float, timeout_s: float = 10.0) -> float:
    """Polls ``read()`` until it reaches ``expected`` (shadow copies finish after the answer)."""
    assert callable(read)
    deadline = time.monotonic() + timeout_s
    value = read()
    while value < expected and time.monotonic() < deadline:
        time.sleep(0.1)  # polling another process's counters
        value = read()
    return float(value)
