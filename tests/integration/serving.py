"""Start a real ``sokuji serve`` process on a free port, for tests that need one."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)  # polling a child process's start-up, not waiting on our own code
    raise TimeoutError(url)


@contextmanager
def sokuji_process(config_body: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Serve ``config_body`` (TOML without ``port``); yields the process and its base URL."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "sokuji.toml"
        # Each server keeps its own state (jobs.sqlite) unless the test names a cache_dir.
        own_dir = "" if "cache_dir" in config_body else f'cache_dir = "{tmp}"\n'
        # gRPC (default 8001) only where the test asks for it: servers run side by side.
        grpc = "" if "grpc_port" in config_body else "grpc_port = 0\n"
        config.write_text(f"port = {port}\nlog_level = \"warning\"\n{grpc}{own_dir}"
                          f"{config_body}")
        proc = subprocess.Popen([sys.executable, "-m", "sokuji", "serve", "--config",
                                 str(config)], stdout=subprocess.DEVNULL)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/v2/health/ready")
            yield proc, f"http://127.0.0.1:{port}"
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=20)


@contextmanager
def sokuji_server(config_body: str) -> Iterator[str]:
    """Serve ``config_body`` (TOML without ``port``); yields the base URL."""
    with sokuji_process(config_body) as (_, url):
        yield url
