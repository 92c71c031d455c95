"""Shared by the benchmark scripts: server processes pinned to a core, a lean concurrency-1
client, a closed-loop load, and ``sokuji bench`` run as a subprocess."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sokuji.bench.engine import parse_server_timing as parse_timing

ROOT = Path(__file__).resolve().parent.parent


def sokuji_bench(url: str, args: list[str], core: int, whole: bool = False) -> dict[str, Any]:
    """``sokuji bench URL ARGS`` on ``core``; returns the result's ``summary`` (``whole``: the
    whole result, samples included)."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    try:
        subprocess.run(["taskset", "-c", str(core), sys.executable, "-m", "sokuji", "bench",
                        url, "--quiet", "--out", str(out), *args], check=False, cwd=ROOT)
        doc = json.loads(out.read_text())
        return dict(doc if whole else doc["summary"])
    finally:
        out.unlink()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process pinned to the server core; ready once its health check answers."""

    def __init__(self, args: argparse.Namespace, command: list[str], port: int,
                 config: str | None = None, ready_path: str = "/v2/health/ready") -> None:
        self.port = port
        self.ready_path = ready_path
        self.command = ["taskset", "-c", str(args.server_core), *command]
        self.cfg: Path | None = None
        if config is not None:
            self.cfg = Path(tempfile.mkstemp(suffix=".toml")[1])
            self.cfg.write_text(config)
            self.command += ["--config", str(self.cfg)]
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def sokuji(cls, args: argparse.Namespace, max_batch_size: int, batching: str) -> Server:
        port = free_port()
        return cls(args, [sys.executable, "-m", "sokuji", "serve"], port, config=f"""
port = {port}
grpc_port = 0
cache_dir = "{args.cache_dir}"
log_level = "warning"
[[models]]
name = "minilm"
cache = false  # measures serving, not caching: the dataset repeats
intra_op_threads = 1
max_batch_size = {max_batch_size}
batching = "{batching}"
""")

    @classmethod
    def bare_http(cls, args: argparse.Namespace) -> Server:
        port = free_port()
        return cls(args, [sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "benchmarks"),
                          "_bare_http:app", "--port", str(port), "--loop", "uvloop", "--http",
                          "httptools", "--no-access-log", "--log-level", "warning"], port)

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(self.command, cwd=ROOT)
        return self.wait_ready(120)

    def wait_ready(self, timeout_s: float) -> Server:
        """Poll ``ready_path`` until it answers 200 (the child's start-up), at most
        ``timeout_s``; an exited child or the timeout raises."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.command}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
                conn.request("GET", self.ready_path)
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)  # polling a child's start-up (refused, or not ready: 404, 503)
        raise TimeoutError(f"server did not become ready: {self.command}")

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        if self.cfg is not None:
            self.cfg.unlink()


def v2_body(text: str) -> bytes:
    return json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": [text]}]}).encode()


class C1Client:
    """Concurrency 1 over one keep-alive connection, with a minimal HTTP/1.1 client (prebuilt
    request bytes, read to Content-Length), so the client's own parsing adds little to the
    figures; returns per-call ms and each response's Server-Timing."""

    def __init__(self, port: int, bodies: list[bytes], path: str = "/v2/models/minilm/infer",
                 headers: dict[str, str] | None = None) -> None:
        self.port = port
        head = "".join(f"{k}: {v}\r\n" for k, v in
                       (headers or {"content-type": "application/json"}).items()).encode()
        self.requests = [
            b"POST " + path.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n" + head
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            for body in bodies]
        self.cursor = 0

    def _call(self, sock: socket.socket, request: bytes) -> tuple[int, bytes]:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v for k, v in (line.split(b": ", 1) for line in lines[1:])}
        if b"content-length" in headers:
            length = int(headers[b"content-length"])
            while len(body) < length:
                body += sock.recv(65536)
        else:  # chunked (Ray Serve's replicas answer so): read to the last, empty chunk
            while not body.endswith(b"0\r\n\r\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("server closed the connection")
                body += chunk
        return status, headers.get(b"server-timing", b"")

    def run(self, calls: int) -> tuple[list[float], list[dict[str, float]]]:
        # A fresh connection per round (servers close idle keep-alive connections), opened by
        # one untimed request.
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._call(sock, self.requests[0])
            lat, stages = [], []
            for _ in range(calls):
                request = self.requests[self.cursor % len(self.requests)]
                self.cursor += 1
                t0 = time.perf_counter()
                status, timing = self._call(sock, request)
                lat.append((time.perf_counter() - t0) * 1e3)
                if status != 200:
                    raise RuntimeError(f"HTTP {status}")
                if timing:
                    stages.append(parse_timing(timing.decode()))
        return lat, stages


async def closed_loop(port: int, bodies: list[bytes], concurrency: int, warmup_s: float,
                      seconds: float, path: str = "/v2/models/minilm/infer",
                      headers: dict[str, str] | None = None) -> dict[str, Any]:
    """``concurrency`` workers, each sending when its last reply arrived; counts the window."""
    import aiohttp

    url = f"http://127.0.0.1:{port}{path}"
    headers = headers or {"content-type": "application/json"}
    done: list[tuple[float, float]] = []
    errors = 0
    begin = time.perf_counter()
    window_start, stop_at = begin + warmup_s, begin + warmup_s + seconds

    async def worker(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal errors
        i = k
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            async with session.post(url, data=bodies[i % len(bodies)], headers=headers) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            t1 = time.perf_counter()
            done.append((t1, t1 - t0))
            i += concurrency

    cpu0 = time.process_time()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        await asyncio.gather(*(worker(s, k) for k in range(concurrency)))
    window = [(t, lat) for t, lat in done if window_start <= t < stop_at]
    # Count from the first completion in the window to the last one: whole batches only, so the
    # rate is not quantised by the batch size (a batch's items all complete at one moment).
    if len(window) < 2:
        raise RuntimeError(f"only {len(window)} completion(s) in the {seconds:.1f} s window: "
                           "measure longer (--seconds)")
    first, last = window[0][0], window[-1][0]
    items = sum(1 for t, _ in window if t > first)
    return {"items": items, "seconds": last - first, "errors": errors,
            "latencies_ms": [lat * 1e3 for _, lat in window],
            "client_cpu_s": time.process_time() - cpu0}


def pooled_rate(rounds: list[dict[str, Any]]) -> float:
    return sum(r["items"] for r in rounds) / sum(r["seconds"] for r in rounds)
