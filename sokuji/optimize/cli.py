"""``sokuji optimize MODEL``: variants of an encoder, measured, gated, recorded.

MODEL is ``minilm`` (the built-in), an ONNX file (``--tokenizer`` or a tokenizer.json beside
it), or a Hugging Face model directory with an encoder (exported to ONNX first, with mean
pooling and L2 normalisation, as the built-in is). Exit codes: 0 if an optimized variant
passed the quality gate, 1 if none did, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sokuji import config as cfg
from sokuji.errors import ConfigError
from sokuji.optimize import pipeline, variants
from sokuji.weights import variant_index


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sokuji optimize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="minilm | path/to/model.onnx | path/to/hf-model-dir")
    p.add_argument("--tokenizer", help="tokenizer.json (ONNX models)")
    p.add_argument("--variants", default=",".join(variants.VARIANTS),
                   help=f"comma-separated, from: {', '.join(variants.VARIANTS)}")
    p.add_argument("--min-cosine", type=float, default=0.99,
                   help="gate: mean cosine to FP32 on the evaluation texts (default 0.99)")
    p.add_argument("--min-recall", type=float, default=0.95,
                   help="gate: recall@10 of FP32's retrieval ranking (default 0.95)")
    p.add_argument("--force", action="append", default=[],
                   help="let the server serve this variant even if it fails the gate")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads to measure with")
    p.add_argument("--cache-dir", dest="cache_dir", help="model repository (default: config's)")
    p.add_argument("--out", help="also write the JSON result here")
    p.add_argument("--html", help="write an HTML report (table + latency/quality plot) here")
    return p


def resolve(args: argparse.Namespace) -> pipeline.Options:
    from sokuji.weights import minilm

    cache_dir = args.cache_dir or cfg.load(overrides={"cache_dir": None}).cache_dir
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in variants.VARIANTS]
    if unknown:
        raise ConfigError(f"unknown variant(s) {', '.join(unknown)}; known: "
                          f"{', '.join(variants.VARIANTS)}", param="--variants")
    common = {"variants": names, "threads": args.threads, "force": tuple(args.force),
              "tolerance": pipeline.Tolerance(args.min_cosine, args.min_recall)}
    if args.model == cfg.DEFAULT_MODEL_NAME:
        return pipeline.Options(model=minilm.ensure_onnx(cache_dir),
                                tokenizer=minilm.tokenizer_path(),
                                config_json=minilm.package_model_dir() / "config.json",
                                max_length=minilm.max_sequence_length(), **common)
    path = Path(args.model)
    if path.is_dir():
        if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
            raise ConfigError.for_key("model", str(path), "a model directory needs config.json "
                                      "and tokenizer.json (a Hugging Face encoder)")
        onnx_path = minilm.ensure_onnx(cache_dir, source=path)
        return pipeline.Options(model=onnx_path, tokenizer=path / "tokenizer.json",
                                config_json=path / "config.json", **common)
    if not path.is_file():
        raise ConfigError.for_key("model", str(path), "no such file or directory")
    tokenizer = Path(args.tokenizer) if args.tokenizer else path.parent / "tokenizer.json"
    if not tokenizer.is_file():
        raise ConfigError.for_key("--tokenizer", str(tokenizer), "no such file: an ONNX "
                                  "model needs its tokenizer.json")
    return pipeline.Options(model=path, tokenizer=tokenizer, **common)


def table(index: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"variants of {index['source']['file']} (recommended: "
                    f"{index['recommended']})")
    for col in ("variant", "MB", "peak MB", "p50 b=1 ms", "best items/s", "speedup",
                "mean cos", "min cos", "recall@10", "verdict"):
        t.add_column(col, justify="left" if col in ("variant", "verdict") else "right")
    for name, v in index["variants"].items():
        f, q = v["figures"], v["quality"]
        verdict = ("recommended" if name == index["recommended"] else
                   "pass" if v["passed"] else "forced" if v["forced"] else "FAIL")
        if not v["kept"]:
            verdict = "not kept (no faster)"
        t.add_row(name, f"{v['bytes'] / 1e6:.1f}", f"{f['peak_rss_mb']:.0f}",
                  f"{f['p50_ms_batch1']:.2f}",
                  f"{f['best_items_per_s']:.0f} (b={f['best_batch']})", f"{v['speedup']:.2f}x",
                  f"{q['mean_cosine']:.4f}", f"{q['min_cosine']:.4f}",
                  f"{q['recall_at_10']:.3f}", verdict)
    return t


def pareto_png(index: dict[str, Any]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    tol = index["tolerance"]
    for ax, key, line in ((axes[0], "mean_cosine", tol["mean_cosine"]),
                          (axes[1], "recall_at_10", tol["recall_at_10"])):
        for name, v in index["variants"].items():
            x, y = v["figures"]["p50_ms_batch1"], v["quality"][key]
            ax.scatter([x], [y], s=60, c="tab:green" if v["passed"] else "tab:red")
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4))
        ax.axhline(line, ls="--", c="grey", label=f"gate {line}")
        ax.set(xlabel="p50 latency at batch 1 (ms; left is faster)", ylabel=key,
               title=f"latency against {key}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def write_html(index: dict[str, Any], path: Path) -> None:
    rows = "".join(
        f"<tr><td>{html.escape(n)}</td><td>{v['bytes'] / 1e6:.1f}</td>"
        f"<td>{v['figures']['p50_ms_batch1']:.2f}</td>"
        f"<td>{v['figures']['best_items_per_s']:.0f}</td><td>{v['speedup']:.2f}</td>"
        f"<td>{v['quality']['mean_cosine']:.4f}</td><td>{v['quality']['min_cosine']:.4f}</td>"
        f"<td>{v['quality']['recall_at_10']:.3f}</td>"
        f"<td>{'pass' if v['passed'] else 'fail'}</td></tr>"
        for n, v in index["variants"].items())
    png = base64.b64encode(pareto_png(index)).decode()
    path.write_text(f"""<!doctype html><meta charset="utf-8"><title>sokuji optimize</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:4px 10px;text-align:right}}
</style><h1>Variants of {html.escape(index['source']['file'])}</h1>
<p>Recommended: <b>{html.escape(index['recommended'])}</b>. Gate: mean cosine &ge;
{index['tolerance']['mean_cosine']}, recall@10 &ge; {index['tolerance']['recall_at_10']},
on {index['eval_set']['texts']} texts and {index['eval_set']['queries']} queries.
Measured {html.escape(index['created'])} with {index['machine']['threads']} thread(s).</p>
<table><tr><th>variant</th><th>MB</th><th>p50 b=1 ms</th><th>best items/s</th>
<th>speedup</th><th>mean cos</th><th>min cos</th><th>recall@10</th><th>gate</th></tr>
{rows}</table><img src="data:image/png;base64,{png}" alt="latency against quality">
<pre>{html.escape(json.dumps(index, indent=1))}</pre>""", encoding="utf-8")


def main(argv: Sequence[str]) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    args = parser().parse_args(argv)
    logging.basicConfig(level="ERROR")  # (ONNX Runtime's fusion passes are chatty)
    console = Console(stderr=True)
    try:
        opts = resolve(args)
    except ConfigError as exc:
        console.print(f"sokuji optimize: {exc.message}")
        return 2
    steps = 2 * len({"fp32", *opts.variants})
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
    with Progress(TextColumn("{task.description:<24}"), BarColumn(), TextColumn(
            "{task.completed}/{task.total}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("optimize", total=steps)
        first = [True]

        def progress(step: str) -> None:
            if not first[0]:
                bar.advance(task)
            first[0] = False
            bar.update(task, description=step)

        index = pipeline.run(opts, progress)
        bar.advance(task)
    out = Console()
    if not out.is_terminal:
        out = Console(width=150)
    out.print(table(index))
    where = variant_index.variants_dir(opts.model) / variant_index.INDEX
    console.print(f"written: {where}")
    if args.out:
        Path(args.out).write_text(json.dumps(index, indent=1))
    if args.html:
        write_html(index, Path(args.html))
        console.print(f"report: {args.html}")
    if not index["any_optimized_passed"]:
        console.print("no optimized variant passed the quality gate")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
