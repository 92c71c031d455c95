"""The ``sokuji optimize`` pipeline: build -> measure -> judge -> gate -> record.

Everything lands in ``<model>.variants/`` next to the model file: one directory per variant
(``model.onnx`` + ``manifest.json``: how it was made, hashes, figures, verdict) and
``index.json`` (all of them, the tolerance, and the recommended variant). The server reads
``index.json`` (``variant = "auto"`` serves the recommended one; passing variants are
addressable as V2 versions).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.optimize import quality, variants
from sokuji.weights.variant_index import INDEX, variants_dir


@dataclass(frozen=True)
class Tolerance:
    mean_cosine: float = 0.99
    recall_at_10: float = 0.95

    def passes(self, q: quality.Quality) -> bool:
        return q.mean_cosine >= self.mean_cosine and q.recall_at_10 >= self.recall_at_10


@dataclass
class Options:
    model: Path
    tokenizer: Path
    config_json: Path | None = None
    variants: Sequence[str] = variants.VARIANTS
    tolerance: Tolerance = field(default_factory=Tolerance)
    threads: int = 1
    max_length: int = 256
    force: Sequence[str] = ()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _measure(opts: Options, path: Path, texts: list[str], queries: list[str],
             work: Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    out_dir = Path(tempfile.mkdtemp(dir=work))
    spec = {"model": str(path), "tokenizer": str(opts.tokenizer), "texts": texts,
            "queries": queries, "threads": opts.threads, "max_length": opts.max_length,
            "out_dir": str(out_dir)}
    proc = subprocess.run([sys.executable, "-m", "sokuji.optimize.measure", json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {path.name} failed: {proc.stderr.strip()[-1500:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    return figures, np.load(out_dir / "texts.npy"), np.load(out_dir / "queries.npy")


def run(opts: Options, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Build, measure and judge every requested variant; write the manifests and the index.
    ``progress`` is called before each step with its description."""
    out = variants_dir(opts.model)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sokuji-optimize-"))
    texts, queries = quality.eval_texts()
    shape = variants.detect_shape(opts.model, opts.config_json)
    entries: dict[str, dict[str, Any]] = {}
    ref: tuple[np.ndarray, np.ndarray] | None = None
    try:
        for name in ("fp32", *[v for v in opts.variants if v != "fp32"]):
            progress(f"build {name}")
            t0 = time.perf_counter()
            if name == "fp32":
                path, recipe = opts.model, {"tool": "none: the original model"}
            else:
                path = out / name / "model.onnx"
                path.parent.mkdir(exist_ok=True)
                recipe = _build(name, opts, out, path, shape, _int8_base(opts, out, entries))
            build_s = time.perf_counter() - t0
            progress(f"measure {name}")
            figures, emb, qemb = _measure(opts, path, texts, queries, work)
            if ref is None:
                ref = (emb, qemb)
            q = quality.compare(ref[0], ref[1], emb, qemb)
            entries[name] = {
                "file": os.path.relpath(path, out.parent), "bytes": path.stat().st_size,
                "sha256": sha256(path), "recipe": recipe, "build_s": round(build_s, 2),
                "figures": figures, "quality": q.as_dict(),
                "passed": opts.tolerance.passes(q), "forced": name in opts.force,
                "kept": True}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fp32 = entries["fp32"]["figures"]["best_items_per_s"]
    for name, e in entries.items():
        e["speedup"] = e["figures"]["best_items_per_s"] / fp32
        if name == "fp16" and e["speedup"] < 1.05:  # kept only when it helps this hardware
            e["kept"] = False
            e["reason"] = "not faster than fp32 on this machine; file removed"
            (out.parent / e["file"]).unlink(missing_ok=True)
        elif not e["passed"]:
            e["reason"] = "below the quality tolerance: not served unless forced"
    candidates = [n for n, e in entries.items() if e["passed"] and e["kept"]]
    recommended = max(candidates, key=lambda n: entries[n]["figures"]["best_items_per_s"])
    index = {
        "schema": "sokuji.optimize/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "root": str(out.parent), "source": {"file": opts.model.name,
                                            "sha256": entries["fp32"]["sha256"]},
        "machine": {"cpus": os.cpu_count(), "threads": opts.threads},
        "tolerance": {"mean_cosine": opts.tolerance.mean_cosine,
                      "recall_at_10": opts.tolerance.recall_at_10},
        "eval_set": {"texts": len(texts), "queries": len(queries)},
        "recommended": recommended,
        "any_optimized_passed": any(n != "fp32" for n in candidates),
        "variants": entries,
    }
    for name, e in entries.items():
        if name != "fp32" and e["kept"]:
            (out / name / "manifest.json").write_text(json.dumps({"variant": name, **e},
                                                                 indent=1))
    (out / INDEX).write_text(json.dumps(index, indent=1))
    return index


def _int8_base(opts: Options, out: Path, entries: dict[str, dict[str, Any]]) -> Path:
    """Quantize whichever of fp32 and opt measured faster (fusions can be slower here)."""
    opt, fp32 = entries.get("opt"), entries.get("fp32")
    if opt is None or fp32 is None or \
            opt["figures"]["best_items_per_s"] <= fp32["figures"]["best_items_per_s"]:
        return opts.model
    return out / "opt" / "model.onnx"


def _build(name: str, opts: Options, out: Path, path: Path, shape: variants.Shape | None,
           int8_base: Path) -> dict[str, Any]:
    opt_path = out / "opt" / "model.onnx"
    if name == "fp16" and not opt_path.is_file():
        opt_path.parent.mkdir(exist_ok=True)
        variants.build_opt(opts.model, opt_path, shape)
    if name == "opt":
        return variants.build_opt(opts.model, path, shape)
    if name == "fp16":
        return variants.build_fp16(opt_path, path)
    if name in ("int8", "int8-mixed"):
        return variants.build_int8(int8_base, path, mixed=name == "int8-mixed",
                                   origin="fp32" if int8_base == opts.model else "opt")
    if name == "int8-static":
        from sokuji.optimize.measure import Encoder

        enc = Encoder(opts.model, opts.tokenizer, opts.threads, opts.max_length)
        return variants.build_int8_static(opts.model, path, enc.feeds,
                                          quality.calibration_texts())
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(variants.VARIANTS)}")
