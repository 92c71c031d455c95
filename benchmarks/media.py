"""Images and audio (issue 14): Sokuji's ``ocr`` and ``vad`` against the packages themselves,
called in-process and behind FastAPI, on the same cores, side by side in one run.

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/media.py [--quick]
        [--server-cores 1] [--client-core 0] [--only ocr|ocr_doc|vad]
        [--out benchmarks/results/media.json]      (~4 minutes quick, ~12 full on 2 cores)

Writes the JSON (every call, the machine probe before and after), the tables as Markdown
(.md) and a plot (.png) beside it; exits 1 if any answer differed from the package's own.

Contenders, all pinned (taskset) to --server-cores; the in-process peers are child processes
(``_media_peer.py``) that load the package once and run orders on request:
- ``rapidocr default``: ``RapidOCR()(bytes)``, ORT's default threads, c=1 only;
- ``rapidocr 1-thread``: the same with ``intra_op_num_threads=1``; at c > 1, c Python threads
  sharing the one engine (what a user's own script would do);
- ``fastapi``: that 1-thread engine behind FastAPI 0.165 (uvicorn, one process, a sync ``def``
  endpoint taking the raw body; ``_media_fastapi.py``);
- ``sokuji batch`` / ``sokuji no-batch`` / ``sokuji chunks``: ``sokuji serve`` with one
  ``ocr`` model (det_threads=1, rec_threads=1): crops of every request share rec batches
  (``cross_request_batching`` true, under the 2560-px width budget) / a request's crops only
  among themselves (false, same budget: the sharing's own effect) / rapidocr's own chunks of
  6 (false, ``rec_max_pixels = 0``: the budget's effect). Files go to the
  raw-file route (the body is the file, as for the FastAPI peer); each file is also sent once
  over V2 (binary tensor extension, and base64 JSON) and those answers are checked too.
- VAD: ``silero`` (``get_speech_timestamps`` with ``load_silero_vad(onnx=True)``: one ORT call
  per 512-sample frame), ``silero sequence`` (silero's own ``get_speech_timestamps_sequence``
  with ``load_silero_vad(sequence=True)``: the model Sokuji serves, up to 512 frames a call),
  each in-process (a model per thread: silero's wrapper holds the stream's state) and behind
  FastAPI (``fastapi``, ``fastapi sequence``), against Sokuji's ``vad`` (instances = the
  number of server cores, 1 thread each).

Parts: ``ocr``: the committed test images (tests/data/media/images/), at --concurrency
(1,2,4,8), --rounds rounds, each a pass over the set in a shuffled order (the same orders for
every contender); ``ocr_doc``: the document page alone (--doc-image), --doc-calls a round at
--doc-concurrency (and rapidocr 1-thread at c=1 as the baseline): rec dominates there, and
concurrent requests' crops of equal width can share batches; ``vad``: a 60 s 16 kHz WAV
built from the committed fixtures (tests/data/media/audio/), --vad-calls a round, at
--vad-concurrency (1,4), in audio seconds per second. For each level, round by round, every
contender runs the round's order in turn (who goes first rotates), so a shared machine's
drift hits all alike; a contender's rounds are pooled. Every server and peer runs each file
once, untimed, first.

Every answer is compared with the package's own output for its file (the 1-thread in-process
peer's untimed pass): OCR texts identical (score difference reported), VAD segments within
one frame. Per-stage p50/p99 come from Sokuji's Server-Timing (rapidocr's own [det, cls, rec]
split in-process); the cross-request sharing from Sokuji's ``sokuji_media_batch_requests``
metric read before and after each run (Server-Timing notes only the first batch of a stage).

Pinning: this process (the HTTP client, aiohttp) runs on --client-core. With the default
(server core 1, client core 0) the client never takes the server's core; with
--server-cores 0,1 it shares core 0 (its CPU time is recorded). Images/s counts every answer
over the wall time of the rounds, so the end of a round (fewer than c in flight) is included;
on one server core any single request keeps the core busy, so this costs little. p99 over a
few dozen files is close to their maximum: read it as such. On a shared machine anything else
running moves every figure; the machine probe (load, wake-ups) is in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Server
from _media_contenders import InProc, servers_for, url_of
from _media_load import (
    CONTENT_TYPES,
    batch_delta,
    batch_metrics,
    closed_loop,
    mismatches,
    summarize,
    v2_checks,
)
from _media_report import PARTS, audio_60s, plot, print_report
from machine import describe
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parent.parent
console = Console()


def files_in(primary: Path, fallback: Path, suffixes: tuple[str, ...]) -> list[Path]:
    for d in (primary, fallback):
        found = sorted(p for p in d.glob("*") if p.suffix.lower() in suffixes) if d.is_dir() \
            else []
        if found:
            return found
    raise SystemExit(f"no {suffixes} files in {primary} or {fallback}")


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's rounds at one level as one run (calls joined, times summed)."""
    shared: dict[str, dict[str, float]] = {}
    for r in runs:
        for stage, v in r.get("shared", {}).items():
            acc = shared.setdefault(stage, {"files": 0, "requests": 0.0, "shared": 0.0})
            acc["files"] += v["files"]
            acc["requests"] += v["mean_requests"] * v["files"]
            acc["shared"] += v["shared_share"] * v["files"]
    return {"calls": [c for r in runs for c in r["calls"]],
            "wall_s": sum(r["wall_s"] for r in runs),
            "cpu_s": sum(r.get("cpu_s") or r.get("client_cpu_s") or 0 for r in runs),
            "rounds": len(runs),
            "shared": {st: {"files": v["files"], "mean_requests": v["requests"] / v["files"],
                            "shared_share": v["shared"] / v["files"]}
                       for st, v in shared.items()}}


def measure(args: argparse.Namespace, kind: str, files: list[Path], orders: list[list[int]],
            levels: list[int], units: list[float], bar: Progress, task: Any,
            baseline_only: tuple[int, ...] = ()) -> dict[str, Any]:
    """Every contender at every level: for each level, round by round, each contender runs
    that round's order (who goes first rotates), so a shared machine's drift hits all alike.
    Returns the summaries, the output checks and the raw calls."""
    blobs = [f.read_bytes() for f in files]
    types = [CONTENT_TYPES.get(f.suffix.lower(), "application/octet-stream") for f in files]
    # (name, the child's options, runs at c > 1 too)
    inproc_specs: list[tuple[str, dict[str, Any], bool]] = (
        [("rapidocr 1-thread", {"threads": 1}, True),
         ("rapidocr default", {"threads": None}, False)] if kind == "ocr"
        else [("silero", {"variant": "stock"}, True),
              ("silero sequence", {"variant": "sequence"}, True)])
    results: dict[str, Any] = {"runs": {}, "checks": {}, "raw": {}}
    servers = servers_for(args, kind)
    peers = {name: InProc(args, kind, files, options, max(levels))
             for name, options, _ in inproc_specs}
    every = {name: all_levels for name, _, all_levels in inproc_specs} | dict.fromkeys(
        servers, True)
    started: list[InProc | Server] = []
    try:
        things: list[InProc | Server] = [*peers.values(), *servers.values()]
        for thing in things:
            try:
                started.append(thing.__enter__())
            except BaseException:
                if thing.proc is not None:  # started but never ready: stop it too
                    thing.proc.kill()
                    thing.proc.wait(timeout=30)
                raise
        first = next(iter(peers.values()))
        reference = results["reference"] = first.reference
        for name, peer in peers.items():
            results["checks"][f"reference:{name}"] = mismatches(
                kind, [{"file": i, **o} for i, o in enumerate(peer.reference)], reference)
        for name, server in servers.items():  # each file once, untimed, checked
            bar.update(task, now=f"{kind}: warming {name}")
            warm = asyncio.run(closed_loop(url_of(name, server, kind), kind, blobs, types,
                                           list(range(len(blobs))), 1, args.timeout_s))
            results["checks"][f"warm:{name}"] = mismatches(kind, warm["calls"], reference)
        for c in levels:
            names = [n for n in every if (c == 1 or every[n])
                     and (c not in baseline_only or n == "rapidocr 1-thread")]
            rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for r, order in enumerate(orders):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    bar.update(task, now=f"{kind}: {name} c={c} round {r + 1}/{len(orders)}")
                    rounds[name].append(run_once(args, kind, name, servers, peers, blobs,
                                                 types, order, c))
                    bar.advance(task)
            for name in names:
                record(results, kind, name, c, pooled(rounds[name]), units, reference, bar)
        for name, server in servers.items():
            if name.startswith("sokuji"):
                v2 = asyncio.run(v2_checks(f"http://127.0.0.1:{server.port}", kind,
                                           "image" if kind == "ocr" else "audio", kind, blobs))
                results["checks"][f"v2:{name}"] = mismatches(kind, v2, reference)
    finally:
        for thing in reversed(started):
            thing.__exit__(None, None, None)
    return results


def run_once(args: argparse.Namespace, kind: str, name: str, servers: dict[str, Server],
             peers: dict[str, InProc], blobs: list[bytes], types: list[str], order: list[int],
             c: int) -> dict[str, Any]:
    if name in peers:
        return peers[name].run(order, c)
    base = f"http://127.0.0.1:{servers[name].port}"
    sokuji = name.startswith("sokuji")
    before = asyncio.run(batch_metrics(base)) if sokuji else {}
    run = asyncio.run(closed_loop(url_of(name, servers[name], kind), kind, blobs, types, order,
                                  c, args.timeout_s))
    if sokuji:
        run["shared"] = batch_delta(before, asyncio.run(batch_metrics(base)))
    return run


def record(results: dict[str, Any], kind: str, name: str, c: int, run: dict[str, Any],
           units: list[float], reference: list[dict[str, Any]], bar: Progress) -> None:
    key = f"{name} c={c}"
    r = results["runs"][key] = {"contender": name, "concurrency": c, "rounds": run["rounds"],
                                **summarize(run["calls"], run["wall_s"], units),
                                "cpu_s": run["cpu_s"]}
    if run["shared"]:
        r["shared_batches"] = run["shared"]
    results["checks"][key] = mismatches(kind, run["calls"], reference)
    results["raw"][key] = [{k: v for k, v in call.items() if k not in ("texts", "scores")}
                           for call in run["calls"]]
    bar.console.print(
        f"  {key:<24} {r['files_per_s']:6.2f} files/s  {r['units_per_s']:7.1f} units/s  "
        f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}  "
        f"mismatched {results['checks'][key]['mismatched']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="c 1 and 4, one round (~3 min)")
    ap.add_argument("--server-cores", default="1", help="taskset CPU list: servers and peers")
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--concurrency", help="OCR levels (default 1,2,4,8; quick 1,4)")
    ap.add_argument("--vad-concurrency", default="1,4")
    ap.add_argument("--rounds", type=int,
                    help="rounds per contender and level, alternated (3; quick 1): OCR, a "
                         "pass over the image set each; VAD, --vad-calls files each")
    ap.add_argument("--vad-calls", type=int, help="VAD: files per round (12)")
    ap.add_argument("--audio-s", type=float, default=60.0, help="VAD file length")
    ap.add_argument("--only", choices=PARTS, default=None)
    ap.add_argument("--doc-image", default="doc_a4.png",
                    help="ocr_doc: this image of the set only (a page of text lines)")
    ap.add_argument("--doc-calls", type=int, default=4, help="ocr_doc: files per round")
    ap.add_argument("--doc-rounds", type=int, help="ocr_doc: rounds (default: --rounds, 2 at "
                                                    "most)")
    ap.add_argument("--doc-concurrency", type=int, default=4)
    ap.add_argument("--no-sokuji", action="store_true", help="peers only (development)")
    ap.add_argument("--images", type=Path, default=ROOT / "tests/data/media/images")
    ap.add_argument("--audio", type=Path, default=ROOT / "tests/data/media/audio")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "media.json"))
    args = ap.parse_args()
    for key, full, quick in (("concurrency", "1,2,4,8", "1,4"), ("rounds", 3, 1),
                             ("vad_calls", 12, 12)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    args.doc_rounds = args.doc_rounds or min(args.rounds, 2)
    levels = [int(c) for c in args.concurrency.split(",")]
    args.vad_c = [int(c) for c in args.vad_concurrency.split(",")]
    os.sched_setaffinity(0, {args.client_core})
    images = files_in(args.images, Path("/work/tools/issue14/img"),
                      (".png", ".jpg", ".jpeg", ".webp"))
    audio_src = files_in(args.audio, Path("/work/tools/issue14/wav"), (".wav", ".flac"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    wav = out.with_suffix(".wav")
    used = audio_60s(audio_src, wav, args.audio_s)
    rng = random.Random(args.seed)
    orders = [rng.sample(range(len(images)), len(images)) for _ in range(args.rounds)]
    report: dict[str, Any] = {
        "command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
        "machine_before": describe(), "images": [p.name for p in images], "orders": orders,
        "audio": {"sources": used, "seconds": args.audio_s}}
    docs = [p for p in images if p.name == args.doc_image]
    parts = [p for p in PARTS if (args.only in (None, p)) and (p != "ocr_doc" or docs)]
    sokuji = 0 if args.no_sokuji else 1
    per_level = 2 + 2 * sokuji  # OCR: rapidocr 1-thread, FastAPI, Sokuji on/off
    total = (  # (rapidocr default runs at c=1 only)
        args.rounds * ("ocr" in parts) * (len(levels) * per_level + (1 in levels))
        + args.doc_rounds * ("ocr_doc" in parts) * (per_level + 1)
        + args.rounds * ("vad" in parts) * len(args.vad_c) * (4 + sokuji))  # 2 in-process,
    # 2 FastAPI
    began = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[now]}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("media", total=total, now="")
        if "ocr" in parts:
            report["ocr"] = measure(args, "ocr", images, orders, levels,
                                    [1.0] * len(images), bar, task)
        if "ocr_doc" in parts:
            # The package's best (one call after another) as the baseline, then c.
            report["ocr_doc"] = measure(args, "ocr", docs, [[0] * args.doc_calls] * args.doc_rounds,
                                        sorted({1, args.doc_concurrency}), [1.0], bar, task,
                                        baseline_only=(1,) if args.doc_concurrency != 1 else ())
        if "vad" in parts:
            report["vad"] = measure(args, "vad", [wav], [[0] * args.vad_calls] * args.rounds,
                                    args.vad_c, [args.audio_s], bar, task)
    report["seconds"] = round(time.monotonic() - began, 1)
    report["machine_after"] = describe()
    summary = print_report(console, report)
    report["summary"] = summary
    out.write_text(json.dumps(report))
    png = out.with_suffix(".png")
    plot(png, report)
    out.with_suffix(".md").write_text(report["markdown"])
    console.print(f"raw figures: {out}; plot: {png}; tables: {out.with_suffix('.md')}")
    bad = sum(c.get("mismatched", 0) for part in PARTS if part in report
              for c in report[part]["checks"].values() if isinstance(c, dict))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
