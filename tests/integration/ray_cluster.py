"""A Ray cluster for the Ray Serve tests, and the real ``sokuji serve --ray`` on it.

One cluster for the Ray tests (``ray_head``), started when the first asks for it, stopped
when the next test does not need it (conftest's teardown hook): ``ray
start --head --block`` in Ray Serve's high-throughput mode (HAProxy + direct ingress), with
short timers (draining, autoscaling metric pushes) and everything it writes under one short
temporary directory: its session, HAProxy's files, the auth token, ``HOME``. Its ports are
chosen free, so two clusters on one machine do not collide. Tests deploy through the real
command, ``sokuji serve --ray --ray-address ...`` (``sokuji_ray``), which joins the cluster
and deletes its application when it gets SIGTERM; one Sokuji application runs at a time
(route ``/``, Serve's one HTTP port).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from sokuji.scale.ray_env import FAST_PATH, HAPROXY_FILES, HAPROXY_PORTS, free_ports

RAY_BIN = Path(sys.executable).parent / "ray"
SOKUJI_BIN = Path(sys.executable).parent / "sokuji"


@dataclass
class RayHead:
    address: str
    env: dict[str, str]
    http_port: int
    base: Path
    """The cluster's directory: its processes are those whose environment names it."""

    def our_pids(self, title: str) -> list[int]:
        """Processes of this cluster whose command line starts with ``title`` (e.g.
        ``ray::ServeReplica:sokuji:Sokuji``)."""
        out = []
        marker = str(self.base).encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes()
                if cmd.startswith(title.encode()) and marker in (d / "environ").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
        return sorted(out)


def ray_env(base: Path) -> dict[str, str]:
    """The environment of the cluster and of every command talking to it."""
    home = base / "home"
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    token = home / ".ray" / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
           "RAY_TMPDIR": str(base / "rt"), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), **FAST_PATH,
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0.5",
           "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
           "RAY_SERVE_HAPROXY_RETRIES": "2"}
    haproxy = base / "h"
    haproxy.mkdir(exist_ok=True)
    for var, name in HAPROXY_FILES.items():
        env[var] = str(haproxy / name) if name else str(haproxy)
    for var, port in zip(HAPROXY_PORTS, free_ports(len(HAPROXY_PORTS)), strict=True):
        env[var] = str(port)
    return env


class _Cluster:
    """The session's cluster: started by the first test that asks, stopped as soon as the
    next test does not need it (``stop_unless_needed``, from conftest's teardown hook), so
    its processes (~1.5 GB, ~0.1 core) never run beside the rest of the suite."""

    def __init__(self) -> None:
        self.head: RayHead | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def get(self) -> RayHead:
        if self.head is None:
            self.head, self.proc = _start()
        return self.head

    def stop(self) -> None:
        if self.head is None or self.proc is None:
            return
        base, proc = self.head.base, self.proc
        self.head = self.proc = None
        # A test cluster needs no graceful stop (``ray start``'s SIGTERM drains for up to
        # 30 s while Serve runs): every process that carries its directory is killed.
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in RayHead("", {}, 0, base).our_pids(""):  # its actors, HAProxy
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


CLUSTER = _Cluster()


def stop_unless_needed(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if "ray_head" in getattr(item, "fixturenames", ()) and (
            nextitem is None or "ray_head" not in getattr(nextitem, "fixturenames", ())):
        CLUSTER.stop()


class _Live:
    """The running cluster, started on first use (module fixtures may hold it)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(CLUSTER.get(), name)


@pytest.fixture(scope="session")
def ray_head() -> RayHead:
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    return cast(RayHead, _Live())


def _start() -> tuple[RayHead, subprocess.Popen[bytes]]:
    base = Path(tempfile.mkdtemp(prefix="skr", dir="/tmp"))  # short: HAProxy's socket path
    env = {**os.environ, **ray_env(base)}
    gcs, client, agent, http = free_ports(4)
    (base / "rt").mkdir()
    with (base / "head.log").open("wb") as log:
        head = subprocess.Popen(
            [str(RAY_BIN), "start", "--head", "--block", f"--port={gcs}",
             f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
             "--num-cpus=2", f"--temp-dir={base / 'rt'}", "--include-dashboard=false",
             "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = (base / "head.log").read_text(errors="replace")
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited: {text[-2000:]}")
        if "Ray runtime started" in text:
            return RayHead(f"127.0.0.1:{gcs}", env, http, base), head
        time.sleep(0.2)
    os.killpg(head.pid, signal.SIGKILL)
    raise TimeoutError(f"ray start not up in 60 s: {text[-2000:]}")


@dataclass
class RayServing:
    url: str
    proc: subprocess.Popen[bytes]
    started: dict[str, object]
    """The command's JSON line once serving (fast_path, replicas, deploy_s, ...)."""
    log: Path


@contextmanager
def sokuji_ray(head: RayHead, config_toml: str, *args: str,
               timeout_s: float = 180.0) -> Iterator[RayServing]:
    """``sokuji serve --ray --ray-address <head>`` with ``config_toml`` (no ``port``: the
    cluster's HTTP port is set); yields once it says it serves, SIGTERM on exit (it deletes
    its application and waits for that)."""
    fd, path = tempfile.mkstemp(suffix=".toml", dir=head.base)
    os.write(fd, config_toml.encode())
    os.close(fd)
    log = Path(path).with_suffix(".log")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(SOKUJI_BIN), "serve", "--ray", "--ray-address", head.address, "--config",
             path, "--port", str(head.http_port), *args], env=head.env, stdout=out,
            stderr=subprocess.STDOUT)
    try:
        started = _started(proc, log, timeout_s)
        yield RayServing(f"http://127.0.0.1:{head.http_port}", proc, started, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _started(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith('{"sokuji"'):
                started: dict[str, object] = json.loads(line)
                return started
        if proc.poll() is not None:
            raise RuntimeError(f"sokuji serve --ray exited {proc.returncode}: "
                               f"{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"sokuji serve --ray not serving after {timeout_s} s: "
                       f"{log.read_text(errors='replace')[-3000:]}")
