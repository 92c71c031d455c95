"""``media.py``'s material and report: the ~60 s test WAV, the tables and ratios (printed, and
as Markdown beside the JSON), and the plot."""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

OCR_SOKUJI, OCR_INPROC, OCR_DEFAULT = "sokuji batch", "rapidocr 1-thread", "rapidocr default"
PARTS = ("ocr", "ocr_doc", "vad")
"""ocr: the image set; ocr_doc: one document page only (where rec dominates); vad."""
VAD_PEERS = ("silero", "silero sequence", "fastapi", "fastapi sequence")
STAGE_ORDER = ("image-decode", "audio-decode", "resample", "resize", "preprocess", "queue",
               "det-wait", "det", "crop", "cls-wait", "cls", "rec-wait", "rec", "infer-wait",
               "infer", "timestamps", "segments", "postprocess")


def audio_60s(sources: list[Path], out: Path, seconds: float) -> list[str]:
    """Concatenates the audio fixtures (every one that reads and lasts 0.5-30 s: the set
    also holds deliberately broken files), each downmixed and resampled to 16 kHz (soxr HQ,
    as Sokuji resamples), cyclically until ``seconds``; writes 16-bit mono PCM at 16 kHz (so
    silero needs no resampling and both sides read the same samples). Returns the files
    used."""
    import numpy as np
    import soundfile as sf
    import soxr

    pieces, used = [], []
    for p in sources:
        try:
            x, rate = sf.read(io.BytesIO(p.read_bytes()), dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError, ValueError):  # deliberately broken fixtures
            continue
        if not 0.5 <= len(x) / rate <= 30:
            continue
        mono = x.mean(axis=1)
        pieces.append(mono if rate == 16000 else soxr.resample(mono, rate, 16000, "HQ"))
        used.append(p.name)
    if not pieces:
        raise SystemExit("no usable audio fixture")
    need = int(seconds * 16000)
    joined = np.concatenate(pieces)
    joined = np.tile(joined, need // len(joined) + 1)[:need]
    pcm = (np.clip(joined, -1, 32767 / 32768) * 32768).astype("<i2")
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return used


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> float | None:
    if not a or not b or not b.get(key) or a.get(key) is None:
        return None
    return float(a[key]) / float(b[key])


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def summary_of(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in (p for p in PARTS if p.startswith("ocr") and p in report):
        runs = report[part]["runs"]
        levels = sorted({r["concurrency"] for r in runs.values()})
        per_c = {}
        for c in levels:
            s, off = runs.get(f"{OCR_SOKUJI} c={c}"), runs.get(f"sokuji no-batch c={c}")
            per_c[c] = {
                "sokuji_over_inproc": _ratio(s, runs.get(f"{OCR_INPROC} c={c}"),
                                             "files_per_s"),
                "sokuji_over_fastapi": _ratio(s, runs.get(f"fastapi c={c}"), "files_per_s"),
                "batch_over_nobatch": _ratio(s, off, "files_per_s"),
                "nobatch_over_chunks": _ratio(off, runs.get(f"sokuji chunks c={c}"),
                                              "files_per_s"),
                "p99_batch_over_nobatch": _ratio(s, off, "p99_ms"),
                "p99_sokuji_over_fastapi": _ratio(s, runs.get(f"fastapi c={c}"), "p99_ms")}
        best1 = max((runs.get(f"{n} c=1") or {}).get("files_per_s", 0)
                    for n in (OCR_INPROC, OCR_DEFAULT))
        best_s = max((r["files_per_s"] for r in runs.values()
                      if r["contender"].startswith("sokuji")), default=None)
        out[part] = {"per_concurrency": per_c,
                      "best_sokuji_over_best_inproc_c1": best_s / best1 if best_s and best1
                      else None}
    if "vad" in report:
        runs = report["vad"]["runs"]
        out["vad"] = {c: {f"sokuji_over_{peer.replace(' ', '_')}": _ratio(
            runs.get(f"sokuji c={c}"), runs.get(f"{peer} c={c}"), "units_per_s")
            for peer in VAD_PEERS} for c in sorted({r["concurrency"] for r in runs.values()})}
    bad = {f"{part}: {k}": v["mismatched"] for part in PARTS if part in report
           for k, v in report[part]["checks"].items() if isinstance(v, dict)}
    out["mismatched_answers"] = sum(bad.values())
    out["checks"] = bad
    return out


def _table(console: Console, md: list[str], title: str, cols: list[str],
           rows: list[list[str]]) -> None:
    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*r)
    console.print(t)
    md += [f"**{title}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(r) + " |" for r in rows] + [""]


def print_report(console: Console, report: dict[str, Any]) -> dict[str, Any]:
    """Prints the tables, writes them as Markdown into report['markdown']; returns ratios."""
    summary = summary_of(report)
    md: list[str] = []
    for part in (p for p in PARTS if p in report):
        unit = "images/s" if part.startswith("ocr") else "audio-s/s"
        runs = report[part]["runs"]
        checks = report[part]["checks"]
        rows = [[r["contender"], str(r["concurrency"]), _f(r["units_per_s"]),
                 _f(r["p50_ms"], ".0f"), _f(r["p99_ms"], ".0f"), str(r["files"]), str(r["errors"]),
                 f"{checks[k]['mismatched']}/{checks[k]['answers']}"]
                for k, r in sorted(runs.items(), key=lambda kv: (kv[1]["concurrency"], kv[0]))]
        _table(console, md, f"{part.upper()}: {unit}, latency (ms)",
               ["contender", "c", unit, "p50", "p99", "answers", "errors", "mismatched"], rows)
        staged = sorted((kv for kv in runs.items() if kv[1]["stages"]),
                        key=lambda kv: (kv[1]["contender"], kv[1]["concurrency"]))
        names = [n for n in STAGE_ORDER if any(n in r["stages"] for _, r in staged)]
        for _, r in staged:
            names += [n for n in r["stages"] if n not in names]
        shown = [n for n in names if n != "total" and any(
            r["stages"].get(n, {}).get("p99_ms", 0) >= 0.5 for _, r in staged)]
        shown += ["total"] if "total" in names else []
        hidden = [n for n in names if n not in shown]
        if staged:
            title = (f"{part.upper()}: stages, p50/p99 ms (Server-Timing; the package's own "
                     f"split in-process; under 0.5 ms at p99 everywhere: "
                     f"{', '.join(hidden) or 'none'})")
            cells = [[f"{r['stages'][n]['p50_ms']:.1f}/{r['stages'][n]['p99_ms']:.1f}"
                      if n in r["stages"] else "" for n in shown] for _, r in staged]
            # The console gets one cell per run (a table of every stage is too wide for it).
            _table(console, [], title, ["run", "stage p50/p99"],
                   [[k, ", ".join(f"{n} {c}" for n, c in zip(shown, row, strict=True) if c)]
                    for (k, _), row in zip(staged, cells, strict=True)])
            md += [f"**{title}**", "", "| run | " + " | ".join(shown) + " |",
                   "|" + "---|" * (len(shown) + 1)]
            md += ["| " + " | ".join([k, *row]) + " |"
                   for (k, _), row in zip(staged, cells, strict=True)] + [""]
        shared_rows = [[k, st, f"{v['files']:.0f}", f"{v['shared_share']:.0%}",
                        f"{v['mean_requests']:.2f}"]
                       for k, r in runs.items() for st, v in r.get("shared_batches", {}).items()]
        if shared_rows:
            _table(console, md, f"{part.upper()}: cross-request batching (Sokuji's "
                   "sokuji_media_batch_requests metric over the run)",
                   ["run", "stage", "files", "shared a batch", "requests in fullest batch"],
                   shared_rows)
        batch_rows = [[k, ", ".join(f"{b}: {n}" for b, n in r["batches"].items())]
                      for k, r in runs.items() if r["batches"]]
        if batch_rows:
            _table(console, md, f"{part.upper()}: first batch of each stage per request "
                   "(Server-Timing's note; a batch of 3 requests is counted by each of the 3)",
                   ["run", "batch: requests"], batch_rows)
        diff = "max_score_diff" if part.startswith("ocr") else "max_boundary_diff_samples"
        other = [[k, f"{v['mismatched']}/{v['answers']}", _f(v.get(diff), ".2g"),
                  str(v.get("examples", [])[:1])[:120]]
                 for k, v in checks.items() if isinstance(v, dict)]
        _table(console, md, f"{part.upper()}: every answer checked against the package's own "
               "output for its file (reference: the in-process peers' untimed pass; warm: "
               "each server's; v2: Sokuji's V2 binary and base64 routes)",
               ["check", "mismatched/answers", diff.replace("_", " "), "first mismatch"], other)
    for part in (p for p in PARTS if p.startswith("ocr") and p in summary):
        best = summary[part]["best_sokuji_over_best_inproc_c1"]
        if best is not None:
            line = (f"{part.upper()}: Sokuji's best images/s (any c) over the package's best "
                    f"(in-process, c=1, either thread setting): {best:.2f}")
            console.print(line)
            md += [line, ""]
        rows = [[str(c), _f(v["sokuji_over_inproc"]), _f(v["sokuji_over_fastapi"]),
                 _f(v["batch_over_nobatch"]), _f(v["nobatch_over_chunks"]),
                 _f(v["p99_batch_over_nobatch"]),
                 _f(v["p99_sokuji_over_fastapi"])]
                for c, v in summary[part]["per_concurrency"].items()]
        _table(console, md, f"{part.upper()} ratios (Sokuji = batching on; in-process = "
               "rapidocr 1-thread at the same c)",
               ["c", "images/s Sokuji/in-process", "Sokuji/FastAPI",
                "shared/own (batch/no-batch)", "budget/chunks (no-batch/chunks)",
                "p99 batch/no-batch", "p99 Sokuji/FastAPI"], rows)
    if "vad" in summary:
        rows = [[str(c), *(_f(v[f"sokuji_over_{p.replace(' ', '_')}"]) for p in VAD_PEERS)]
                for c, v in summary["vad"].items()]
        _table(console, md, "VAD ratios: Sokuji's audio-s/s over each peer's",
               ["c", *VAD_PEERS], rows)
    m = report["machine_before"]
    md.append(f"Machine: {m['cpu']}, {m['cores']} cores; load average "
              f"{m['load_average'][0]:.2f} at the start, "
              f"{report['machine_after']['load_average'][0]:.2f} at the end; thread wake-up "
              f"p50 {m['thread_wakeup_us']['p50']:.0f} µs. Command: `{report['command']}`.")
    report["markdown"] = "\n".join(md) + "\n"
    return summary


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in PARTS if p in report]
    fig, axes = plt.subplots(len(parts), 3, figsize=(19, 4.6 * len(parts)), squeeze=False)
    for row, part in zip(axes, parts, strict=True):
        runs = report[part]["runs"]
        unit = "images/s" if part.startswith("ocr") else "audio seconds / s"
        names = sorted({r["contender"] for r in runs.values()})
        for name in names:
            pts = sorted((r["concurrency"], r["units_per_s"], r["p99_ms"])
                         for r in runs.values() if r["contender"] == name)
            xs = [p[0] for p in pts]
            row[0].plot(xs, [p[1] for p in pts], marker="o", label=name)
            row[1].plot(xs, [p[2] for p in pts], marker="o", label=name)
        row[0].set(xlabel="concurrency", ylabel=unit, title=f"{part.upper()}: throughput",
                   xscale="log", ylim=(0, None))
        row[1].set(xlabel="concurrency", ylabel="p99 latency (ms)",
                   title=f"{part.upper()}: p99", xscale="log", yscale="log")
        for ax in row[:2]:
            ax.set_xticks(sorted({r["concurrency"] for r in runs.values()}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.get_xaxis().set_minor_locator(matplotlib.ticker.NullLocator())
            ax.legend(fontsize=8)
        _stage_bars(row[2], part, runs)
    fig.suptitle("Sokuji ocr/vad vs the packages in-process and behind FastAPI, same cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _stage_bars(ax: Any, part: str, runs: dict[str, Any]) -> None:
    """Where the time goes: each run's stage p50s side by side (waits included; a p50 per
    stage, so the bars need not add up to the total's p50)."""
    keys = [k for k, r in sorted(runs.items(), key=lambda kv: (kv[1]["contender"],
                                                                kv[1]["concurrency"]))
            if any(n != "total" for n in r["stages"])]
    # Leaf stages only: preprocess = image-decode + resize, queue = det-wait, and OCR's
    # generic infer spans det..rec (VAD's infer is the model's own, recorded last).
    spans = {"decode", "cache", "preprocess", "queue", "batch", "encode", "total"} | (
        {"infer"} if part.startswith("ocr") else set())
    names: list[str] = []
    for k in keys:
        names += [n for n in runs[k]["stages"] if n not in spans and n not in names]
    for y, k in enumerate(keys):
        left = 0.0
        for j, n in enumerate(names):
            v = runs[k]["stages"].get(n, {}).get("p50_ms", 0.0)
            ax.barh(y, v, left=left, color=_colour(j), label=n if y == 0 else None)
            left += v
    ax.set_yticks(range(len(keys)), keys, fontsize=7)
    ax.set(xlabel="ms (each stage's p50, stacked)", title=f"{part.upper()}: stages at p50")
    handles = [matplotlib_patch(_colour(j), n) for j, n in enumerate(names)]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _colour(j: int) -> Any:
    import matplotlib

    return matplotlib.colormaps["tab20"](j % 20)


def matplotlib_patch(colour: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=colour, label=label)
