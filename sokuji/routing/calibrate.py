"""`sokuji route calibrate ROUTER`: fit a cascade's escalation threshold on labelled data.

A cascade of classifiers (below) or of generators (``generation.py``: the small generator's
confidence is its answer's mean token log-probability; an answer is right when it contains
one of the question's accepted answers); the threshold is fitted the same way.

The cascade's small classifier answers; an item whose margin (top-1 minus top-2 score) is
below the threshold θ goes to the large one. On a labelled calibration set both classifiers
score every query once; then, for every candidate θ (each distinct margin), the cascade's
accuracy, its escalation rate and its compute cost follow without running anything again:

    acc(θ)  = mean(S if m >= θ else L)         S, L: small / large right; m: small's margin
    cost(θ) = c_s + P(m < θ) · c_l             c_s, c_l: measured single-query times

Two rules choose θ:
- ``--target-escalation r``: the share ``r`` of queries with the lowest margins escalates
  (RouteLLM's calibration to a share of strong-model calls; labels not needed).
- ``--target-quality q``: the smallest θ whose cascade keeps ``q`` of large-only accuracy,
  judged on the lower end (5th percentile) of a paired bootstrap of acc(θ) / acc_large, not
  on the point estimate.

The table shows, per θ: escalated share, accuracy (and ÷ large), cost ÷ large, and the
misroutes: easy queries escalated (the small one was right: wasted compute) and hard ones
kept (small wrong, large right: lost accuracy). ``--test`` reports the chosen θ on held-out
data. The result is written to ``<cache_dir>/routers/<router>/calibration.json``, which the
router reads at start when its ``threshold = "calibrated"``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.routing.threshold_fit import (
    Scored,
    fit_escalation,
    fit_quality,
    held_out,
    row,
    save,
    table,
)


def _generates(model: Any) -> bool:
    """A generator: kind llama, or an upstream speaking OpenAI."""
    if model is None:
        return False
    return model.runtime == "llama" or (model.runtime == "upstream"
                                        and model.options.get("protocol") == "openai")


def read_labelled(path: str | Path) -> tuple[list[str], list[str]]:
    texts, labels = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            texts.append(row["text"])
            labels.append(row["label"])
    return texts, labels


def score(small: Any, large: Any, texts: list[str], labels: list[str]) -> Scored:
    """Run both classifiers (runtimes with ``classify`` and ``labels``) on the set."""
    from sokuji.runtimes.classifier import margin

    s, lg = small.classify(texts), large.classify(texts)
    s_pred = np.asarray([small.labels[i] for i in s.argmax(axis=1)])
    l_pred = np.asarray([large.labels[i] for i in lg.argmax(axis=1)])
    truth = np.asarray(labels)
    return Scored(s_pred == truth, l_pred == truth, margin(s))


def time_per_query(runtime: Any, texts: list[str], n: int = 30) -> float:
    """Median seconds of one query alone (batch 1): the compute a routed request costs."""
    runtime.classify(texts[:2])  # warm
    times = []
    for text in texts[:n]:
        t0 = time.perf_counter()
        runtime.classify([text])
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    from sokuji import config as cfg
    from sokuji.repository import registry
    from sokuji.routing.router import calibration_path
    from sokuji.runtimes.classifier import ClassifierRuntime

    p = argparse.ArgumentParser(prog="sokuji route calibrate", description=__doc__.split(
        "\n")[0])
    p.add_argument("router")
    p.add_argument("--config", help="the server's TOML config (where the router is)")
    p.add_argument("--labelled", required=True, help="JSONL {text, label}: calibration set "
                   "(generators: {text, answers})")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--target-escalation", type=float, help="share of queries escalated")
    goal.add_argument("--target-quality", type=float,
                      help="share of large-only accuracy to keep (e.g. 0.98)")
    p.add_argument("--test", help="JSONL {text, label}: held-out set to report on")
    p.add_argument("--out", help="where to write (default: the cache's calibration.json)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--max-tokens", type=int, default=24,
                   help="generators: the most tokens of each answer (default 24)")
    args = p.parse_args(argv)
    console = Console(stderr=args.json)
    config = cfg.load(args.config)
    mc = config.model(args.router)
    if mc is None or mc.runtime != "router":
        raise SystemExit(f"no router '{args.router}' in the config")
    names = [m.name for m in config.models]
    opts = registry.get(mc.runtime).parse(mc, f"models[{names.index(mc.name)}]")
    if opts.kind != "cascade":
        raise SystemExit(f"router '{args.router}' is a {opts.kind} router, not a cascade")
    if all(_generates(config.model(n)) for n in opts.targets):
        from sokuji.routing.generation import calibrate_generation

        return calibrate_generation(args, config, opts, console)
    runtimes = []
    with console.status("loading the two classifiers"):
        for name in opts.targets:
            model = config.model(name)
            assert model is not None
            options = registry.get(model.runtime).parse(model, f"models[{names.index(name)}]")
            rt = ClassifierRuntime(model, options, config)
            rt.load()
            runtimes.append(rt)
    small, large = runtimes
    texts, labels = read_labelled(args.labelled)
    with console.status(f"scoring {len(texts)} labelled queries with both"):
        sc = score(small, large, texts, labels)
        c_s, c_l = time_per_query(small, texts), time_per_query(large, texts)
    ratio = c_s / c_l
    if args.target_escalation is not None:
        theta, rule, bound = fit_escalation(sc, args.target_escalation), \
            f"escalation {args.target_escalation}", None
    else:
        theta, bound = fit_quality(sc, args.target_quality)
        rule = f"quality {args.target_quality}"
    sweep = [row(sc, t, ratio) for t in (0.0, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2,
                                         0.3, 1.0)]
    chosen = row(sc, theta, ratio)
    result: dict[str, Any] = {
        "router": args.router, "threshold": theta, "rule": rule, "bootstrap_low": bound,
        "small": opts.targets[0], "large": opts.targets[1],
        "small_accuracy": float(sc.small_ok.mean()), "large_accuracy": float(sc.large_ok.mean()),
        "small_ms": c_s * 1e3, "large_ms": c_l * 1e3, "calibration": asdict(chosen),
        "labelled": str(args.labelled), "labelled_sha256": hashlib.sha256(
            Path(args.labelled).read_bytes()).hexdigest(), "n": len(texts)}
    if args.test:
        t_texts, t_labels = read_labelled(args.test)
        tsc = score(small, large, t_texts, t_labels)
        result["test"] = held_out(tsc, theta, ratio)
    out = Path(args.out) if args.out else calibration_path(config.cache_dir, args.router)
    if save(result, out, args.json):
        return 0
    console.print(table(sweep, f"{args.router}: calibration set, {len(texts)} queries "
                        f"(small {sc.small_ok.mean():.3f}, large {sc.large_ok.mean():.3f}; "
                        f"{c_s * 1e3:.1f} vs {c_l * 1e3:.1f} ms a query)"))
    console.print(table([chosen], f"chosen by {rule}: θ = {theta:.4f}"))
    if args.test:
        console.print(f"held-out test ({result['test']['n']}): accuracy "
                      f"{result['test']['accuracy']:.3f} = {result['test']['of_large']:.3f} of "
                      f"large, cost {result['test']['cost_of_large']:.3f} of large, escalated "
                      f"{result['test']['escalated']:.1%}")
    console.print(f"written: {out}")
    return 0
