"""Model variants through the server: how much more load does an INT8 variant carry than FP32
at the same p99 SLO?

    .venv/bin/python benchmarks/variants_serving.py [--slo-ms 300]      (~8 minutes)

1. ``sokuji optimize`` on a copy of the built-in MiniLM (all variants; int8 forced so that it
   can be served for comparison even if it fails the gate), on the server core.
2. For fp32, the recommended variant and int8: a server serving that variant (1 thread,
   cache off, core 1), and ``sokuji bench --sweep`` on core 0: Poisson arrivals of the mixed
   dataset, from --start-rate up by x1.15 until p99 exceeds the SLO. Goodput = the best
   throughput of a step that met it.
Prints goodput ratios against fp32 (target for the recommended INT8 variant: >= 1.5x, while
passing the quality gate) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import Server, free_port  # noqa: E402

from sokuji.weights import minilm  # noqa: E402


def optimize(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = work / "model.onnx"
    shutil.copy(minilm.ensure_onnx(args.cache_dir), model)
    shutil.copy(minilm.tokenizer_path(), work / "tokenizer.json")
    out = work / "optimize.json"
    subprocess.run(["taskset", "-c", str(args.server_core), sys.executable, "-m", "sokuji",
                    "optimize", str(model), "--force", "int8", "--out", str(out),
                    "--html", str(work / "optimize.html")], check=False, cwd=ROOT)
    return dict(json.loads(out.read_text()))


def sweep(args: argparse.Namespace, work: Path, variant: str) -> dict[str, Any]:
    port = free_port()
    server = Server(args, [sys.executable, "-m", "sokuji", "serve"], port, config=f"""
port = {port}
cache_dir = "{args.cache_dir}"
log_level = "warning"
[[models]]
name = "enc"
path = "{work / 'model.onnx'}"
tokenizer = "{work / 'tokenizer.json'}"
variant = "{variant}"
cache = false
intra_op_threads = 1
max_queue_depth = 64
""")
    out = work / f"sweep-{variant}.json"
    with server:
        subprocess.run(["taskset", "-c", str(args.client_core), sys.executable, "-m", "sokuji",
                        "bench", f"http://127.0.0.1:{port}", "--target", "v2", "--model", "enc",
                        "--dataset", "mixed", "--rate", str(args.start_rate), "--sweep",
                        "--sweep-factor", "1.15", "--sweep-steps", "16",
                        "--slo", f"p99={args.slo_ms}ms", "--duration", str(args.step_s),
                        "--warmup", "2s", "--quiet", "--out", str(out)], check=False, cwd=ROOT)
    result = json.loads(out.read_text())
    sw = result["sweep"]
    return {"goodput_rps": sw["goodput_rps"], "max_rate_meeting_slo": sw["max_rate_meeting_slo"],
            "steps": [{"rate": s["rate"], "throughput_rps": s["summary"].get("throughput_rps"),
                       "p99_ms": (s["summary"].get("latency_ms") or {}).get("p99"),
                       "slo_ok": s["slo_ok"]} for s in sw["steps"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slo-ms", type=float, default=300.0)
    ap.add_argument("--start-rate", type=float, default=12.0)
    ap.add_argument("--step-s", type=float, default=8.0)
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         "variants_serving.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sokuji-variants-"))
    try:
        index = optimize(args, work)
        chosen = index["recommended"]
        order = ["fp32", *(v for v in (chosen, "int8") if v != "fp32")]
        sweeps = {}
        for variant in dict.fromkeys(order):
            print(f"sweep: {variant} ...", flush=True)
            sweeps[variant] = sweep(args, work, variant)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = sweeps["fp32"]["goodput_rps"]
    print(f"\nrecommended variant: {chosen}; p99 SLO {args.slo_ms:.0f} ms, mixed dataset, "
          "1 thread")
    print(f"{'variant':12s} {'gate':5s} {'mean cos':>9s} {'recall@10':>9s} {'goodput':>9s} "
          f"{'vs fp32':>8s}")
    for variant, sw in sweeps.items():
        v = index["variants"][variant]
        print(f"{variant:12s} {'pass' if v['passed'] else 'FAIL':5s} "
              f"{v['quality']['mean_cosine']:9.4f} {v['quality']['recall_at_10']:9.3f} "
              f"{sw['goodput_rps']:7.1f}/s {sw['goodput_rps'] / base:7.2f}x")
    result = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M"),
              "cpus": os.cpu_count(), "optimize": index, "sweeps": sweeps,
              "recommended": chosen,
              "ratio_recommended": sweeps[chosen]["goodput_rps"] / base}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"raw figures: {out}")


if __name__ == "__main__":
    main()
