"""``media.py``'s contenders: the in-process peers (children running ``_media_peer.py``), the
FastAPI peers and the Sokuji servers, each pinned to the server cores."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from _harness import Server, free_port

ROOT = Path(__file__).resolve().parent.parent


class InProc:
    """An in-process peer: a child pinned to the server cores that loads the package once,
    runs every file once (warm-up; its outputs are the reference) and then runs orders on
    request (``_media_peer.py``), so its rounds can alternate with the servers'."""

    def __init__(self, args: argparse.Namespace, kind: str, files: list[Path],
                 options: dict[str, Any], max_concurrency: int) -> None:
        spec = {"kind": kind, "files": [str(f) for f in files],
                "max_concurrency": max_concurrency, **options}
        self.command = ["taskset", "-c", args.server_cores, sys.executable,
                        str(ROOT / "benchmarks" / "_media_peer.py"), json.dumps(spec)]
        self.proc: subprocess.Popen[str] | None = None
        self.reference: list[dict[str, Any]] = []

    def __enter__(self) -> InProc:
        self.proc = subprocess.Popen(self.command, cwd=ROOT, text=True, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self.reference = self._read()["reference"]
        return self

    def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"in-process peer exited {self.proc.wait()}: {self.command}")
        return dict(json.loads(line))

    def run(self, order: list[int], concurrency: int) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"order": order, "concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()  # the child's signal to finish
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def sokuji_config(port: int, args: argparse.Namespace, model: str, options: str) -> str:
    return f"""port = {port}
grpc_port = 0
cache_dir = "{args.cache_dir}"
log_level = "warning"
builtin_pipelines = false
[cache]
enabled = false  # measures serving: the image set repeats
[[models]]
name = "{model}"
runtime = "{model}"
cache = false
max_batch_size = 8
max_queue_depth = 64
max_request_bytes = {64 * 1024 * 1024}
[models.options]
{options}
"""


def servers_for(args: argparse.Namespace, kind: str) -> dict[str, Server]:
    srv_args = argparse.Namespace(server_core=args.server_cores)
    out: dict[str, Server] = {}
    peers = ({"fastapi": ["MEDIA_PEER_THREADS=1"]} if kind == "ocr" else
             {f"fastapi{suffix}": [f"MEDIA_PEER_MODELS={max(args.vad_c)}",
                                   f"MEDIA_PEER_VAD={variant}"]
              for suffix, variant in (("", "stock"), (" sequence", "sequence"))})
    for name, env in peers.items():
        port = free_port()
        out[name] = Server(srv_args, ["env", f"MEDIA_PEER_KIND={kind}", *env, sys.executable,
                                      "-m", "uvicorn", "--app-dir", str(ROOT / "benchmarks"),
                                      "_media_fastapi:app", "--port", str(port), "--loop",
                                      "uvloop", "--http", "httptools", "--no-access-log",
                                      "--log-level", "warning"], port, ready_path="/health")
    if args.no_sokuji:
        return out
    cmd = [sys.executable, "-m", "sokuji", "serve"]
    if kind == "ocr":
        # on: crops of every request share rec batches of one width, under the width
        # budget; no-batch: a request's crops only among themselves, same budget (the
        # sharing's own effect); chunks: rapidocr's chunks of 6, no budget (the budget's).
        for name, on, budget in (("sokuji batch", "true", 2560),
                                 ("sokuji no-batch", "false", 2560),
                                 ("sokuji chunks", "false", 0)):
            port = free_port()
            out[name] = Server(srv_args, cmd, port, config=sokuji_config(
                port, args, "ocr", f"cross_request_batching = {on}\nrec_max_pixels = "
                                   f"{budget}\ndet_threads = 1\nrec_threads = 1"))
    else:
        port = free_port()
        cores = len(args.server_cores.split(","))
        out["sokuji"] = Server(srv_args, cmd, port, config=sokuji_config(
            port, args, "vad", f"instances = {cores}\nthreads = 1"))
    return out


def url_of(name: str, server: Server, kind: str) -> str:
    base = f"http://127.0.0.1:{server.port}"
    return (f"{base}/{kind}" if name.startswith("fastapi")
            else f"{base}/v2/models/{kind}/infer")
