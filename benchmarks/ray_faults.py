"""A replica SIGKILLed under load on Ray Serve, per HAProxy retry setting; and autoscaling on
Sokuji's queue depth.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ray_faults.py [--rounds 5] [--quick]
        [--no-autoscale] [--out benchmarks/results/ray_faults.json]
        (~2.5 minutes on 2 shared cores, ~40 s a setting; --quick: 2 rounds,
        retry_lost = true only, ~50 s)

Per setting, its own cluster (``ray start --head`` with the test fixture's settings,
``tests/integration/ray_cluster.py``: Serve's high-throughput mode, HAProxy + direct
ingress, ``--num-cpus=2``), since HAProxy reads its retry policy from the cluster's
environment when it starts:

- ``retry_lost=false``: Ray's default (``retry-on conn-failure``), what ``[ray] retry_lost =
  false`` leaves;
- ``retry_lost=true``: ``conn-failure empty-response``, 2 retries (what ``retry_lost = true``,
  the default, sets for a local cluster: ``sokuji/scale/ray_env.py``);
- ``retry_lost=true,retries=5``: the same with 5 retries.

In it the real ``sokuji serve --ray --ray-address ...`` deploys 2 replicas of a synthetic
50 ms model (``fast``, max_batch_size 2: the config of ``tests/integration/test_ray_faults.py``).
Each round: 8 closed-loop clients through HAProxy (Serve's HTTP port), each on its own
keep-alive connection; once both replicas answer, one replica process is SIGKILLed; load goes
on until 40 requests sent 2 s or more after the kill were answered and a new replica has
answered (or 60 s). Per kill: requests lost (no 200), requests HAProxy resent (its access
log, received on a UDP syslog socket of ours: the retries field), the slowest resent one;
kill -> Serve shows a replica STARTING, kill -> 2 RUNNING again (``serve.status()``, after it
first showed fewer), kill -> 2 replica processes again, kill -> the new replica's first
answer (``x-sokuji-replica``). Between rounds: 2 RUNNING.

Autoscaling (the ``retry_lost=true`` cluster, after its rounds; the config of the autoscaling
test: 1..3 replicas, target 2 waiting per replica, look-back 1 s, upscale delay 0.5 s,
downscale 2 s): 16 clients on 1 replica; load start -> a second replica process, -> its
first answer; replicas 3 s later; load stop -> back to 1 replica process; statuses.

Everything is torn down at the end (the command's SIGTERM, the head's process group, every
process carrying the cluster's directory). Prints a table; writes the raw JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from machine import describe  # noqa: E402

from sokuji.scale.ray_env import free_ports  # noqa: E402
from tests.integration.ray_cluster import RAY_BIN, RayHead, ray_env, sokuji_ray  # noqa: E402
from tests.integration.test_ray_faults import (  # noqa: E402
    AUTOSCALE,
    KILL,
    REPLICA,
    Load,
    asked_by,
)

PATH = "/v2/models/fast/infer"
SETTINGS: dict[str, dict[str, str | None]] = {
    # None: the variable is removed (Ray's default applies)
    "retry_lost=false": {"RAY_SERVE_HAPROXY_RETRY_ON": None, "RAY_SERVE_HAPROXY_RETRIES": None},
    "retry_lost=true": {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
                        "RAY_SERVE_HAPROXY_RETRIES": "2"},
    "retry_lost=true,retries=5": {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
                                  "RAY_SERVE_HAPROXY_RETRIES": "5"},
}
# httplog: ... actconn/feconn/beconn/srv_conn/retries srv_queue/backend_queue "METHOD path ..."
RETRIES = re.compile(r" \d+/\d+/\d+/\d+/(\+?)(\d+) \d+/\d+ \"")
TIMERS = re.compile(r" -?\d+/-?\d+/-?\d+/-?\d+/(-?\d+) (\d{3}) ")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Syslog:
    """HAProxy's log target: a UDP socket of ours; each datagram with its arrival time."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.lines: list[tuple[float, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.lines.append((time.monotonic(), data.decode(errors="replace")))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close()


class Cluster:
    """One ``ray start --head --block`` with the fixture's settings, ``env`` overriding."""

    def __init__(self, overrides: dict[str, str | None], syslog: Syslog, base: Path) -> None:
        # ``base`` and the environment (``ray_env``: auth token, HAProxy's files and ports)
        # come from the parent: Ray reads RAY_AUTH_MODE when it is imported.
        self.base = base
        env = dict(os.environ)
        for k, v in overrides.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        env["RAY_SERVE_HAPROXY_LOG_TARGET"] = f"127.0.0.1:{syslog.port}"
        self.env = env
        gcs, client, agent, http = free_ports(4)
        (self.base / "rt").mkdir()
        with (self.base / "head.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [str(RAY_BIN), "start", "--head", "--block", f"--port={gcs}",
                 f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
                 "--num-cpus=2", f"--temp-dir={self.base / 'rt'}", "--include-dashboard=false",
                 "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.head = RayHead(f"127.0.0.1:{gcs}", env, http, self.base)
        until = time.monotonic() + 90
        while "Ray runtime started" not in (self.base / "head.log").read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > until:
                text = (self.base / "head.log").read_text(errors="replace")
                self.stop()
                raise RuntimeError(f"ray start failed: {text[-2000:]}")
            time.sleep(0.2)

    def connect(self) -> None:
        """This process as a driver of the cluster, for ``serve.status()``."""
        import ray

        ray.init(address=self.head.address, namespace="serve", log_to_driver=False,
                 logging_level="error")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            import ray

            if ray.is_initialized():
                ray.shutdown()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pid in self.head.our_pids(""):  # its actors, HAProxy, anything left (not us)
            if pid == os.getpid():
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)


def replica_states() -> dict[str, int]:
    from ray import serve

    try:
        app = serve.status().applications["sokuji"]
        dep = next(iter(app.deployments.values()))
        return {str(getattr(k, "value", k)): int(v) for k, v in dep.replica_states.items()}
    except Exception:  # noqa: BLE001 - the controller busy or the app not there: no reading
        return {}


class Watch:
    """Polls ``serve.status()`` and the replica processes every 0.1 s after a kill."""

    def __init__(self, head: RayHead, victim: int, killed: float) -> None:
        self.head, self.victim, self.killed = head, victim, killed
        self.starting: float | None = None
        self.degraded = False
        self.running2: float | None = None
        self.procs2: float | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set() and (self.running2 is None or self.procs2 is None):
            now = time.monotonic() - self.killed
            states = replica_states()
            if states:
                if self.starting is None and states.get("STARTING", 0):
                    self.starting = now
                if states.get("RUNNING", 0) < 2 or len(states) > 1:
                    self.degraded = True
                elif self.degraded and self.running2 is None:
                    self.running2 = now
            pids = self.head.our_pids(REPLICA)
            if self.procs2 is None and len(pids) == 2 and self.victim not in pids:
                self.procs2 = now
            time.sleep(0.1)

    def close(self, bound_s: float = 60.0) -> None:
        t0 = time.monotonic()
        while (self.running2 is None or self.procs2 is None) and time.monotonic() - t0 < bound_s:
            time.sleep(0.1)
        self.stop.set()
        self.thread.join(5)


def wait(check: Any, bound_s: float, every_s: float = 0.05) -> bool:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > bound_s:
            return False
        time.sleep(every_s)  # polling other processes
    return True


def kill_round(head: RayHead, syslog: Syslog) -> dict[str, Any]:
    wait(lambda: replica_states().get("RUNNING", 0) == 2
         and len(head.our_pids(REPLICA)) == 2, 90, 0.2)
    before = head.our_pids(REPLICA)
    log_from = len(syslog.lines)
    with Load(head.http_port, PATH, clients=8) as load:
        wait(lambda: len(load.replicas()) == 2, 60)
        seen = load.replicas()
        victim = before[0]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        watch = Watch(head, victim, killed)
        wait(lambda: sum(1 for a in list(load.answers) if a.sent > killed + 2.0
                         and a.status == 200) >= 40
             and bool(load.replicas() - seen), 60)
    watch.close()
    answers = list(load.answers)
    new = [a.sent + a.took - killed for a in answers if a.replica and a.replica not in seen]
    if not new:  # the load stopped first: ask one at a time
        ask = asked_by(head.http_port)
        if wait(lambda: ask() not in seen, 60):
            new = [time.monotonic() - killed]
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[str(a.status)] = statuses.get(str(a.status), 0) + 1
    lines = syslog.lines[log_from:]
    resent, redispatched, slowest, non200 = [], 0, 0, []
    for t, line in lines:
        m, tm = RETRIES.search(line), TIMERS.search(line)
        if m and int(m.group(2)) > 0:
            resent.append(line)
            redispatched += m.group(1) == "+"
            if tm:
                slowest = max(slowest, int(tm.group(1)))
        if not (tm and tm.group(2) == "200"):
            non200.append([round(t - killed, 3), line])
    return {
        "requests": len(answers), "statuses": statuses,
        "failed": [[round(a.sent - killed, 3), round(a.took, 3), a.status]
                   for a in answers if a.status != 200],
        "resent_by_haproxy": len(resent), "redispatched": redispatched,
        "slowest_resent_ms": slowest,
        "kill_to_starting_s": None if watch.starting is None else round(watch.starting, 2),
        "kill_to_running_again_s": None if watch.running2 is None else round(watch.running2, 2),
        "kill_to_2_processes_s": None if watch.procs2 is None else round(watch.procs2, 2),
        "kill_to_new_replica_answering_s": round(min(new), 2) if new else None,
        "non200_log": non200[:40], "retried_log": resent[:40],
    }


def autoscale(head: RayHead) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with sokuji_ray(head, AUTOSCALE, timeout_s=300) as serving:
        out["max_replicas"] = serving.started.get("max_replicas")
        wait(lambda: len(head.our_pids(REPLICA)) == 1, 60, 0.2)
        with Load(head.http_port, PATH, clients=16) as load:
            t0 = load.t0
            ok = wait(lambda: len(head.our_pids(REPLICA)) >= 2, 60)
            out["load_to_2nd_replica_process_s"] = round(time.monotonic() - t0, 2) if ok else None
            ok = wait(lambda: len(load.replicas()) >= 2, 60)
            out["load_to_2nd_replica_answering_s"] = (round(time.monotonic() - t0, 2)
                                                      if ok else None)
            time.sleep(3.0)  # the measurement: replicas 3 s later
            out["replicas_3s_later"] = len(head.our_pids(REPLICA))
        stopped = time.monotonic()
        ok = wait(lambda: len(head.our_pids(REPLICA)) == 1, 60, 0.1)
        out["stop_to_1_replica_s"] = round(time.monotonic() - stopped, 2) if ok else None
        statuses: dict[str, int] = {}
        for a in load.answers:
            statuses[str(a.status)] = statuses.get(str(a.status), 0) + 1
        out["requests"] = len(load.answers)
        out["statuses"] = statuses
        asked_by(head.http_port)()
    return out


def one_setting(args: argparse.Namespace) -> int:
    """One setting: its cluster, its kill rounds (and autoscaling for retry_lost=true)."""
    name, got = args.one, {}
    res: dict[str, Any] = {"env": {k: v for k, v in SETTINGS[name].items() if v is not None},
                           "rounds": []}
    got["setting"] = res
    syslog = Syslog()
    say(f"{name}: starting a cluster")
    cluster = Cluster(SETTINGS[name], syslog, Path(args.base))
    try:
        cluster.connect()
        with sokuji_ray(cluster.head, KILL.format(jobs="enabled = false"),
                        timeout_s=300) as serving:
            assert serving.started["fast_path"] is True, serving.started
            for r in range(args.rounds):
                row = kill_round(cluster.head, syslog)
                res["rounds"].append(row)
                say(f"{name} round {r + 1}/{args.rounds}: {row['requests']} requests, "
                    f"lost {len(row['failed'])} {row['statuses']}, resent "
                    f"{row['resent_by_haproxy']}, kill->STARTING "
                    f"{row['kill_to_starting_s']} s, ->2 RUNNING "
                    f"{row['kill_to_running_again_s']} s, ->2 processes "
                    f"{row['kill_to_2_processes_s']} s, ->new replica answering "
                    f"{row['kill_to_new_replica_answering_s']} s")
        if name == "retry_lost=true" and not args.no_autoscale:
            say("autoscaling: 16 clients on 1 replica")
            got["autoscale"] = autoscale(cluster.head)
            say(f"autoscaling: {got['autoscale']}")
    finally:
        say(f"{name}: stopping the cluster")
        cluster.stop()
        syslog.close()
        Path(args.out).write_text(json.dumps(got, indent=1))
    return 0


def span(values: list[Any]) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    return f"{min(v):.1f}-{max(v):.1f} s" if len(v) > 1 else f"{v[0]:.1f} s"


def table(report: dict[str, Any]) -> str:
    rows = ["| setting | requests | lost per kill | resent per kill | kill -> STARTING "
            "| kill -> 2 RUNNING | kill -> new replica answering |",
            "|---|---|---|---|---|---|---|"]
    for name, s in report["settings"].items():
        r = s["rounds"]
        if not r:
            rows.append(f"| {name} | no round completed | | | | | |")
            continue
        lost = ", ".join(str(len(x["failed"])) for x in r)
        resent = [x["resent_by_haproxy"] for x in r]
        rows.append(f"| {name} | {sum(x['requests'] for x in r):,} | {lost} | "
                    f"{min(resent)}-{max(resent)} | "
                    f"{span([x['kill_to_starting_s'] for x in r])} | "
                    f"{span([x['kill_to_running_again_s'] for x in r])} | "
                    f"{span([x['kill_to_new_replica_answering_s'] for x in r])} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="kills per setting")
    ap.add_argument("--quick", action="store_true",
                    help="2 rounds, retry_lost=true only")
    ap.add_argument("--no-autoscale", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ray_faults.json"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one setting, in a child
    ap.add_argument("--base", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one_setting(args)
    rounds = 2 if args.quick else args.rounds
    settings = ["retry_lost=true"] if args.quick else list(SETTINGS)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"benchmark": "ray_faults", "command": " ".join(sys.argv),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "args": vars(args), "machine_before": describe(), "settings": {}}
    began = time.monotonic()
    try:
        for name in settings:
            # each setting in a child process: its own driver connection to its own cluster
            part = out.with_suffix(f".{len(report['settings'])}.part")
            base = Path(tempfile.mkdtemp(prefix="skf", dir="/tmp"))  # short: HAProxy's socket
            cmd = [sys.executable, __file__, "--one", name, "--rounds", str(rounds),
                   "--out", str(part), "--base", str(base)] + (
                       ["--no-autoscale"] if args.no_autoscale else [])
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ray_env(base)}
                                    ).returncode
            finally:
                shutil.rmtree(base, ignore_errors=True)
            if part.exists():
                got = json.loads(part.read_text())
                part.unlink()
                report["settings"][name] = got["setting"]
                if "autoscale" in got:
                    report["autoscale"] = got["autoscale"]
            if rc:
                say(f"{name}: the child exited {rc}")
                report.setdefault("failed_settings", []).append(name)
    finally:
        report["seconds"] = round(time.monotonic() - began, 1)
        report["machine_after"] = describe()
        out.write_text(json.dumps(report, indent=1))
    print(table(report))
    for name, s in report["settings"].items():
        slow = [x["slowest_resent_ms"] for x in s["rounds"] if x["resent_by_haproxy"]]
        if slow:
            print(f"{name}: slowest resent request {min(slow)}-{max(slow)} ms "
                  f"(median {statistics.median(slow)})")
    if "autoscale" in report:
        print("autoscaling:", json.dumps(report["autoscale"]))
    print(f"raw figures: {out}; {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
