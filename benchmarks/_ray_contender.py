"""A Sokuji server process tree for benchmarks: ``sokuji serve`` or ``sokuji serve --ray``
(with the local cluster it starts) under its own HOME, Ray temp dir and auth token; its
processes found by a marker in their environment (other sessions' clusters on the machine are
not counted), their CPU and memory by group (replica, haproxy, driver, ray)."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import free_port

ROOT = Path(__file__).resolve().parent.parent


def proc_stat(pid: int) -> tuple[float, float] | None:
    """(CPU seconds, RSS MB) of ``pid``."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return ((int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"),
            int(f[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20)


class Contender:
    """One server process tree (single, or a Ray command with its local cluster)."""

    def __init__(self, name: str, replicas: int, cores: str, args: argparse.Namespace,
                 base: Path, config: str) -> None:
        self.name, self.replicas, self.cores, self.args = name, replicas, cores, args
        self.dir = Path(tempfile.mkdtemp(prefix=name, dir=base))
        self.port = free_port()
        self.mark = f"SOKUJI_BENCH_MARK={self.dir}".encode()
        (self.dir / "rt").mkdir()
        self.cfg = self.dir / "c.toml"
        self.cfg.write_text(config.format(port=self.port, tmp=self.dir / "rt"))
        home = self.dir / "home"
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
        self.env = {**os.environ, "SOKUJI_BENCH_MARK": str(self.dir), "HOME": str(home),
                    "XDG_CACHE_HOME": str(home / ".cache"), "RAY_TMPDIR": str(self.dir / "rt"),
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN_PATH": str(home / ".ray" / "auth_token")}
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Contender:
        cmd = ["taskset", "-c", self.cores, sys.executable, "-m", "sokuji", "serve",
               "--config", str(self.cfg)]
        if self.replicas:
            cmd += ["--ray", "--replicas", str(self.replicas)]
        log = (self.dir / "log").open("wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - t0 < 300:
            text = (self.dir / "log").read_text(errors="replace")
            if self.replicas and '{"sokuji"' in text:
                break
            if not self.replicas and self.ready():
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {text[-3000:]}")
            time.sleep(0.3)
        else:
            raise TimeoutError(f"{self.name} not serving after 300 s")
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids():  # anything of ours the command left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)

    def ready(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
            conn.request("GET", "/v2/health/ready")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def pids(self) -> dict[int, str]:
        """This contender's processes (by the marker in their environment) and their group:
        replica (the server itself when single), haproxy, driver (the ``sokuji serve --ray``
        command), ray (the rest of the cluster)."""
        out = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if self.mark + b"\0" not in (d / "environ").read_bytes() + b"\0":
                    continue
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "taskset" in cmd.split(" ", 1)[0]:
                continue
            out[int(d.name)] = ("replica" if cmd.startswith("ray::ServeReplica")
                                or not self.replicas else
                                "haproxy" if "haproxy" in cmd else
                                "driver" if " sokuji serve " in cmd else "ray")
        return out

    def usage(self) -> dict[str, dict[str, float]]:
        """CPU seconds and RSS MB by group, now."""
        groups: dict[str, dict[str, float]] = {}
        for pid, group in self.pids().items():
            got = proc_stat(pid)
            if got:
                g = groups.setdefault(group, {"cpu_s": 0.0, "rss_mb": 0.0, "processes": 0})
                g["cpu_s"] += got[0]
                g["rss_mb"] += got[1]
                g["processes"] += 1
        return groups

    def direct_port(self) -> int | None:
        """The (one) replica's own direct-ingress port: a listening socket of its process in
        Serve's 30000-31000 range."""
        replica = [p for p, g in self.pids().items() if g == "replica"]
        if len(replica) != 1:
            return None
        inodes = set()
        for fd in Path(f"/proc/{replica[0]}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            port = int(f[1].split(":")[1], 16)
            if f[3] == "0A" and f[9] in inodes and 30000 <= port <= 31000:
                return port
        return None


def cpu_split(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
              items: int, wall: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for g in after:
        used = after[g]["cpu_s"] - before.get(g, {}).get("cpu_s", 0.0)
        out[f"{g}_cpu_ms_per_request"] = used * 1e3 / items
        out[f"{g}_cores"] = used / wall
    out["server_cpu_ms_per_request"] = sum(v for k, v in out.items()
                                           if k.endswith("_per_request"))
    return out
