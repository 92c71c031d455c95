"""The load engine: closed-loop workers or an open-loop schedule, over one aiohttp session.

Open loop: every request has an intended send time fixed in advance; its latency is measured
from that time, so a server that stalls cannot hide the stall by slowing the client down (no
coordinated omission). Sending never waits for replies. If the client itself falls behind its
schedule, the lag is recorded per request and reported.

Closed loop: ``concurrency`` workers, each sending when its previous reply has arrived;
latency is measured from the actual send.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from sokuji.bench.dataset import Sampler
from sokuji.bench.targets import StreamParse, Target


@dataclass
class Record:
    """One request, times in seconds from the start of the run."""

    intended_s: float
    sent_s: float
    done_s: float = 0.0
    status: int = 0
    error: str | None = None
    """None for success; otherwise 'http_<status>', 'timeout' or 'connection'."""
    warmup: bool = False
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    stages_ms: dict[str, float] | None = None

    @property
    def latency_s(self) -> float:
        return self.done_s - self.intended_s

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.intended_s


@dataclass
class RunResult:
    records: list[Record]
    started_s: float
    """perf_counter() at the start, for reference only."""
    wall_s: float
    client_cpu_s: float
    mode: str


def parse_server_timing(header: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in header.split(","):
        name, _, rest = part.strip().partition(";")
        for param in rest.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur":
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
    return out


Progress = Callable[[Record], None]
SPIN_S = 0.002


async def _until(deadline: float) -> None:
    """Wake at ``deadline`` (perf_counter seconds). The selector's timeouts have millisecond
    resolution, so sleep until just before, then yield to other tasks until the moment."""
    delay = deadline - time.perf_counter()
    if delay > SPIN_S:
        await asyncio.sleep(delay - SPIN_S)
    while time.perf_counter() < deadline:
        await asyncio.sleep(0)


class Engine:
    def __init__(self, target: Target, sampler: Sampler, *, timeout_s: float = 60.0,
                 progress: Progress | None = None) -> None:
        self.target = target
        self.sampler = sampler
        self.timeout_s = timeout_s
        self.progress = progress
        self._url = target.url
        self._headers = target.request_headers()

    async def _one(self, session: aiohttp.ClientSession, t0: float, intended_s: float,
                   warmup: bool) -> Record:
        body = self.target.body(self.sampler.next())
        sent = time.perf_counter() - t0
        rec = Record(intended_s=intended_s, sent_s=sent, warmup=warmup)
        try:
            async with session.post(self._url, data=body, headers=self._headers) as resp:
                rec.status = resp.status
                timing = resp.headers.get("server-timing")
                if timing:
                    rec.stages_ms = parse_server_timing(timing)
                if self.target.streaming and resp.status == 200:
                    await self._read_stream(resp, rec, t0)
                else:
                    await resp.read()
                if resp.status != 200:
                    rec.error = f"http_{resp.status}"
        except TimeoutError:
            rec.error = "timeout"
        except aiohttp.ClientError:
            rec.error = "connection"
        rec.done_s = time.perf_counter() - t0
        if self.progress is not None:
            self.progress(rec)
        return rec

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: Record, t0: float) -> None:
        parser = StreamParse()
        last: float | None = None
        async for data in resp.content.iter_any():
            now = time.perf_counter() - t0
            if parser.feed(data):
                if last is None:
                    rec.ttft_s = now - rec.intended_s
                else:
                    rec.itl_s.append(now - last)
                last = now
        rec.output_tokens = parser.output_tokens

    def _session(self, limit: int) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit, force_close=False),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def closed(self, concurrency: int, *, duration_s: float | None = None,
                     count: int | None = None, warmup_s: float = 0.0,
                     warmup_count: int = 0) -> RunResult:
        """``concurrency`` workers until ``duration_s`` (after warm-up) or ``count`` requests
        (after ``warmup_count``) have been sent."""
        records: list[Record] = []
        sent = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        stop_at = None if duration_s is None else warmup_s + duration_s
        total = None if count is None else count + warmup_count

        async def worker(session: aiohttp.ClientSession) -> None:
            nonlocal sent
            while True:
                now = time.perf_counter() - t0
                if (stop_at is not None and now >= stop_at) or \
                        (total is not None and sent >= total):
                    return
                warm = now < warmup_s or sent < warmup_count
                sent += 1
                records.append(await self._one(session, t0, now, warm))

        async with self._session(concurrency) as session:
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return RunResult(records, t0, time.perf_counter() - t0, time.process_time() - cpu0,
                         "closed")

    async def open(self, times_s: np.ndarray, *, warmup_s: float = 0.0,
                   warmup_count: int = 0) -> RunResult:
        """Send one request at each intended time (seconds from now), never waiting for
        replies; then wait for all of them."""
        tasks: list[asyncio.Task[Record]] = []
        cpu0, t0 = time.process_time(), time.perf_counter()
        async with self._session(0) as session:
            for i, intended in enumerate(times_s.tolist()):
                await _until(t0 + intended)
                warm = intended < warmup_s or i < warmup_count
                tasks.append(asyncio.create_task(self._one(session, t0, intended, warm)))
            records = list(await asyncio.gather(*tasks))
        return RunResult(records, t0, time.perf_counter() - t0, time.process_time() - cpu0,
                         "open")
