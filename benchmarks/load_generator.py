"""Is ``sokuji bench`` a trustworthy instrument? Two checks, one run.

    .venv/bin/python benchmarks/load_generator.py        (needs wrk: apt-get install -y wrk)

1. Agreement with wrk: the same target (Sokuji serving a synthetic model with a known service
   time), the same closed-loop concurrency, rounds alternating wrk and ``sokuji bench``;
   prints the throughput ratio and both p50s.
2. The client's own cost: ``sokuji bench`` against a server that answers at once (the bare
   HTTP app), at concurrency 1 (round trip) and 16 (the client's ceiling).
Servers run on core 1, clients on core 0. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import Server, free_port, sokuji_bench  # noqa: E402

BODY = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                               "data": ["how do I reset the password on my router"]}]})


def wrk(url: str, concurrency: int, seconds: float, core: int) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(f'wrk.method = "POST"\nwrk.body = {json.dumps(BODY)}\n'
                'wrk.headers["Content-Type"] = "application/json"\n')
        script = f.name
    out = subprocess.run(["taskset", "-c", str(core), "wrk", "-t1", f"-c{concurrency}",
                          f"-d{int(seconds)}s", "--latency", "-s", script, url],
                         capture_output=True, text=True, check=True).stdout
    os.unlink(script)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    return {"requests_per_s": rps,
            "p50_ms": float(p50.group(1)) * scale[p50.group(2)] if p50 else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "load_generator.json"))
    args = p.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")

    port = free_port()
    config = f"""
port = {port}
log_level = "warning"
[[models]]
name = "minilm"
runtime = "synthetic"
cache = false
max_batch_size = 8
options = {{base_ms = 2.0, per_item_ms = 0.25}}
"""
    report: dict[str, Any] = {"benchmark": "load_generator",
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "settings": vars(args), "rounds": []}
    url = f"http://127.0.0.1:{port}"
    with Server(args, [sys.executable, "-m", "sokuji", "serve"], port, config=config):
        for i in range(args.rounds):
            w = wrk(url + "/v2/models/minilm/infer", args.concurrency, args.seconds,
                    args.client_core)
            s = sokuji_bench(url, ["--concurrency", str(args.concurrency), "--duration",
                            str(args.seconds), "--warmup", "1s", "--dataset", "short"],
                      args.client_core)
            report["rounds"].append({"wrk": w, "sokuji_bench": {
                "requests_per_s": s["throughput_rps"], "p50_ms": s["latency_ms"]["p50"]}})
            print(f"round {i + 1}: wrk {w['requests_per_s']:.1f} req/s p50 {w['p50_ms']:.2f} ms"
                  f" | sokuji bench {s['throughput_rps']:.1f} req/s p50 "
                  f"{s['latency_ms']['p50']:.2f} ms", flush=True)
    rounds = report["rounds"]
    ratio = sum(r["sokuji_bench"]["requests_per_s"] for r in rounds) / \
        sum(r["wrk"]["requests_per_s"] for r in rounds)

    bare = Server.bare_http(args)
    with bare:
        base = f"http://127.0.0.1:{bare.port}"
        c1 = sokuji_bench(base, ["--concurrency", "1", "--duration", "5", "--warmup", "1s"],
                   args.client_core)
        c16 = sokuji_bench(base, ["--concurrency", "16", "--duration", "5", "--warmup", "1s"],
                    args.client_core)
    report["client"] = {"c1_p50_ms": c1["latency_ms"]["p50"],
                        "c1_requests_per_s": c1["throughput_rps"],
                        "c16_requests_per_s": c16["throughput_rps"],
                        "c16_cpu_fraction": c16["client"]["cpu_fraction"]}
    report["ratios"] = {"sokuji_bench_over_wrk_throughput": ratio}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nsokuji bench / wrk throughput, same target, c={args.concurrency}: {ratio:.3f}")
    print(f"client round trip against an instant server, c=1: p50 "
          f"{report['client']['c1_p50_ms']:.3f} ms; client ceiling at c=16: "
          f"{report['client']['c16_requests_per_s']:.0f} req/s "
          f"({report['client']['c16_cpu_fraction']:.0%} of a core)")
    print(f"raw JSON: {out}")


if __name__ == "__main__":
    main()
