"""The cascade on a real task with ground truth (issue 15): small-only, large-only and the
cascade router at several thresholds, through a real ``sokuji serve``, on the intent set
written for the project (``sokuji/routing/data/intents_*.jsonl``: 20 intents, 300
calibration and 500 test queries).

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/cascade.py [--quick]
        [--out benchmarks/results/cascade.json]            (~6 min on 2 cores; --quick ~2)

Phase 1: a server with the two classifiers (MiniLM, MPNet; one intra-op thread each, pinned
to --server-cores) scores the calibration split; ``routing/calibrate.fit_quality`` picks the
smallest θ whose bootstrap 5th percentile keeps 98% of large-only accuracy. Phase 2: a
server with both classifiers and a cascade router per θ (a fixed grid and the calibrated
one); every test query goes, one at a time (c = 1, so latency is the request's own), to
small, large and each cascade. Per system: accuracy (Wilson 95%), ÷ large, mean and p99
latency (client), compute (the ``infer`` stages of ``Server-Timing``: the time the models
ran for it, both of them when escalated), ÷ large, escalated share, and the misroutes
(easy queries escalated: small was right; hard ones kept: small wrong, large right). The
oracle router (escalate exactly where small is wrong and large right) bounds what a better
confidence signal could do. JSON, a Markdown table and a plot (accuracy vs compute).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._harness import free_port, percentile  # noqa: E402
from sokuji.routing import calibrate, stats  # noqa: E402
from tests.integration.serving import wait_ready  # noqa: E402

DATA = ROOT / "sokuji" / "routing" / "data"
GRID = (0.02, 0.05, 0.1)
INFER = re.compile(r"(?:^|, )infer;dur=([0-9.]+)")


def server(models: str, cores: str, cache_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="sokuji-cascade-")
    cfg = Path(tmp) / "sokuji.toml"
    cfg.write_text(f'port = {port}\ngrpc_port = 0\nlog_level = "warning"\n'
                   f'cache_dir = "{cache_dir}"\n'
                   f'builtin_pipelines = false\n[cache]\nenabled = false\n'
                   f'[jobs]\nenabled = false\n{models}')
    proc = subprocess.Popen(["taskset", "-c", cores, sys.executable, "-m", "sokuji", "serve",
                             "--config", str(cfg)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, f"{url}/v2/health/ready", timeout_s=300)
    return proc, url


def classifiers() -> str:
    out = ""
    for name, enc in (("small", "minilm"), ("large", "mpnet")):
        out += (f'[[models]]\nname = "{name}"\nruntime = "classifier"\nintra_op_threads = 1\n'
                f'inline_max_ms = 0\noptions = {{ encoder = "{enc}" }}\n')
    return out


def cascade(name: str, theta: float) -> str:
    return (f'[[models]]\nname = "{name}"\nruntime = "router"\noptions = {{ kind = "cascade", '
            f'targets = ["small", "large"], threshold = {theta!r} }}\n')


def ask(url: str, model: str, text: str) -> tuple[np.ndarray, float, float, str]:
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": [text]}]}).encode()
    req = urllib.request.Request(f"{url}/v2/models/{model}/infer", body,
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        doc = json.loads(r.read())
        timing = r.headers.get("server-timing", "")
        served = r.headers.get("x-sokuji-served-by", model)
    ms = (time.perf_counter() - t0) * 1e3
    compute = sum(float(m) for m in INFER.findall(timing))
    return np.asarray(doc["outputs"][0]["data"], np.float32), ms, compute, served


def labels_of(url: str) -> list[str]:
    """The classifier's labels: sorted, as the runtime orders its scores."""
    rows = [json.loads(x) for x in (DATA / "intents_prototypes.jsonl").read_text().split("\n")
            if x.strip()]
    return sorted({r["label"] for r in rows})


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.progress import Progress

    calib = calibrate.read_labelled(DATA / "intents_calib.jsonl")
    test = calibrate.read_labelled(DATA / "intents_test.jsonl")
    if args.quick:
        calib = (calib[0][::3], calib[1][::3])
        test = (test[0][::4], test[1][::4])
    cache_dir = args.cache_dir
    labels: list[str] = []
    with Progress() as bar:
        proc, url = server(classifiers(), args.server_cores, cache_dir)
        try:
            labels = labels_of(url)
            task = bar.add_task("calibration: small and large", total=len(calib[0]))
            s_ok, l_ok, margins = [], [], []
            for text, label in zip(*calib, strict=True):
                s, *_ = ask(url, "small", text)
                lg, *_ = ask(url, "large", text)
                s_ok.append(labels[int(s.argmax())] == label)
                l_ok.append(labels[int(lg.argmax())] == label)
                top = np.sort(s)[-2:]
                margins.append(float(top[1] - top[0]))
                bar.advance(task)
        finally:
            proc.terminate()
            proc.wait(30)
        sc = calibrate.Scored(np.array(s_ok), np.array(l_ok), np.array(margins, np.float32))
        theta_cal, low = calibrate.fit_quality(sc, 0.98)
        systems = {"small": None, "large": None}
        models = classifiers()
        for i, theta in enumerate((*GRID, theta_cal)):
            name = "cascade-cal" if i == len(GRID) else f"cascade-{theta:g}"
            systems[name] = theta
            models += cascade(name, theta)
        proc, url = server(models, args.server_cores, cache_dir)
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        try:
            task = bar.add_task("test: every system, c=1", total=len(test[0]))
            for text, label in zip(*test, strict=True):
                for name in systems:
                    out, ms, compute, served = ask(url, name, text)
                    rows[name].append({"ok": labels[int(out.argmax())] == label, "ms": ms,
                                       "compute_ms": compute, "served_by": served})
                bar.advance(task)
        finally:
            proc.terminate()
            proc.wait(30)
    return summarise(rows, systems, theta_cal, low, len(calib[0]))


def summarise(rows: dict[str, list[dict[str, Any]]], systems: dict[str, float | None],
              theta_cal: float, low: float, n_calib: int) -> dict[str, Any]:
    small = np.array([r["ok"] for r in rows["small"]])
    large = np.array([r["ok"] for r in rows["large"]])
    l_acc = float(large.mean())
    l_compute = float(np.mean([r["compute_ms"] for r in rows["large"]]))
    table = []
    for name, theta in systems.items():
        ok = np.array([r["ok"] for r in rows[name]])
        ms = [r["ms"] for r in rows[name]]
        compute = float(np.mean([r["compute_ms"] for r in rows[name]]))
        esc = np.array(["large" in r["served_by"] for r in rows[name]]) \
            if theta is not None else np.zeros(len(ok), bool)
        lo, hi = stats.wilson(int(ok.sum()), len(ok))
        table.append({
            "system": name, "threshold": theta, "accuracy": float(ok.mean()),
            "accuracy_ci": [lo, hi], "of_large": float(ok.mean()) / l_acc,
            "mean_ms": float(np.mean(ms)), "p99_ms": percentile(ms, 99),
            "compute_ms": compute, "compute_of_large": compute / l_compute,
            "escalated": float(esc.mean()),
            "easy_escalated": int((esc & small).sum()),
            "hard_kept": int((~esc & ~small & large).sum()) if theta is not None else None})
    oracle = (~small) & large
    return {"benchmark": "cascade", "date": time.strftime("%Y-%m-%d %H:%M"),
            "n_test": len(small), "n_calib": n_calib, "calibrated_threshold": theta_cal,
            "calibration_bootstrap_low": low, "mcnemar": {
                "small_right_large_wrong": int((small & ~large).sum()),
                "small_wrong_large_right": int(oracle.sum())},
            "oracle": {"accuracy": float((small | large).mean()),
                       "escalated": float(oracle.mean())},
            "systems": table, "rows": rows}


def report(result: dict[str, Any], out: Path) -> None:
    lines = [f"cascade on {result['n_test']} test queries (θ calibrated on "
             f"{result['n_calib']}: {result['calibrated_threshold']:.4f})", "",
             "| system | θ | accuracy (95% CI) | ÷ large | mean ms | p99 ms | compute ms | "
             "compute ÷ large | escalated | easy escalated | hard kept |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["systems"]:
        theta = "" if r["threshold"] is None else f"{r['threshold']:.4f}"
        lines.append(
            f"| {r['system']} | {theta} | {r['accuracy']:.3f} ({r['accuracy_ci'][0]:.3f}–"
            f"{r['accuracy_ci'][1]:.3f}) | {r['of_large']:.3f} | {r['mean_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['compute_ms']:.1f} | {r['compute_of_large']:.3f} | "
            f"{r['escalated']:.1%} | {r['easy_escalated']} | {r['hard_kept'] or ''} |")
    m, o = result["mcnemar"], result["oracle"]
    lines += ["", f"discordant pairs: small right/large wrong {m['small_right_large_wrong']}, "
              f"small wrong/large right {m['small_wrong_large_right']}; oracle router: "
              f"accuracy {o['accuracy']:.3f} escalating {o['escalated']:.1%}"]
    text = "\n".join(lines)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in result["systems"]:
        ax.errorbar(r["compute_of_large"], r["accuracy"],
                    yerr=[[r["accuracy"] - r["accuracy_ci"][0]],
                          [r["accuracy_ci"][1] - r["accuracy"]]], fmt="o", capsize=3)
        ax.annotate(r["system"], (r["compute_of_large"], r["accuracy"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("compute ÷ large-only")
    ax.set_ylabel("accuracy (test)")
    ax.set_title("intent cascade: MiniLM -> MPNet by margin")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--server-cores", default="1")
    p.add_argument("--cache-dir", default=os.environ.get(
        "SOKUJI_TEST_CACHE_DIR", str(ROOT / ".cache" / "sokuji")))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                   "cascade.json")
    args = p.parse_args()
    report(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
