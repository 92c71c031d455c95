"""The HTTP side of ``media.py``: a closed-loop client that posts whole files as raw request
bodies (the same request to Sokuji's raw-file route and to the FastAPI peer), the V2 requests
that check Sokuji's V2 answers, Server-Timing with its notes, and the summaries.

A run: ``concurrency`` workers share one sequence of file indices; each takes the next index
when its last answer arrived. Every answer is kept (its file, ms, status, Server-Timing and
decoded output) so that each one can be compared with the package's own output."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import struct
import time
from collections import Counter
from typing import Any

import aiohttp
from _harness import percentile

CONTENT_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
                 ".webp": "image/webp", ".wav": "audio/wav", ".flac": "audio/flac"}
BATCH_NOTE = re.compile(r"batch (\d+) (?:of|from) (\d+) requests?")


def timing_entries(header: str) -> dict[str, tuple[float, str]]:
    """Server-Timing as {name: (dur ms, desc)} (``parse_server_timing`` drops the desc)."""
    out: dict[str, tuple[float, str]] = {}
    for m in re.finditer(r'\s*([^,;=\s]+)((?:\s*;\s*[a-z]+=(?:"[^"]*"|[^,;]*))*)', header):
        dur, desc = 0.0, ""
        for key, value in re.findall(r';\s*([a-z]+)=("[^"]*"|[^,;]*)', m.group(2)):
            if key == "dur":
                try:
                    dur = float(value)
                except ValueError:
                    continue
            elif key == "desc":
                desc = value.strip('"')
        out[m.group(1)] = (dur, desc)
    return out


def output_of(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """The comparable part of a raw-route answer (Sokuji's or the FastAPI peer's)."""
    if kind == "ocr":
        lines = body.get("lines", [])
        return {"texts": [ln["text"] for ln in lines],
                "scores": [float(ln["score"]) for ln in lines]}
    # Sokuji's segments carry seconds and samples; the FastAPI peer's, samples.
    return {"segments": [[int(s["start_sample"]), int(s["end_sample"])] if "start_sample" in s
                         else [int(s["start"]), int(s["end"])]
                         for s in body.get("segments", [])]}


async def closed_loop(url: str, kind: str, blobs: list[bytes], types: list[str],
                      order: list[int], concurrency: int, timeout_s: float) -> dict[str, Any]:
    calls: list[dict[str, Any]] = []
    cursor = iter(range(len(order)))
    begin = time.perf_counter()

    async def worker(session: aiohttp.ClientSession) -> None:
        while (k := next(cursor, None)) is not None:
            i = order[k]
            t0 = time.perf_counter()
            async with session.post(url, data=blobs[i],
                                    headers={"content-type": types[i]}) as r:
                raw = await r.read()
                ms = (time.perf_counter() - t0) * 1e3
                call: dict[str, Any] = {"file": i, "ms": ms, "status": r.status,
                                        "end_s": time.perf_counter() - begin,
                                        "timing": r.headers.get("server-timing", "")}
            if r.status == 200:
                call.update(output_of(kind, json.loads(raw)))
            else:
                call["error"] = raw[:300].decode(errors="replace")
            calls.append(call)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    cpu0 = time.process_time()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return {"wall_s": time.perf_counter() - begin, "client_cpu_s": time.process_time() - cpu0,
            "calls": calls}


def v2_binary(name: str, data: bytes) -> tuple[bytes, dict[str, str]]:
    """A V2 request with one BYTES element in the binary tensor extension."""
    element = struct.pack("<I", len(data)) + data
    header = json.dumps({"inputs": [{"name": name, "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": len(element)}}]}
                        ).encode()
    return header + element, {"content-type": "application/octet-stream",
                              "inference-header-content-length": str(len(header))}


def v2_base64(name: str, data: bytes) -> tuple[bytes, dict[str, str]]:
    return json.dumps({"inputs": [{"name": name, "datatype": "BYTES", "shape": [1],
                                   "parameters": {"content_type": "base64"},
                                   "data": [base64.b64encode(data).decode()]}]}).encode(), \
        {"content-type": "application/json"}


def v2_output(kind: str, raw: bytes, headers: Any) -> dict[str, Any]:
    """The comparable part of a V2 answer (JSON, or binary outputs after a JSON header)."""
    length = headers.get("inference-header-content-length")
    body = json.loads(raw[:int(length)] if length else raw)
    outs = {o["name"]: o for o in body["outputs"]}
    if kind == "ocr":
        texts = outs["text"].get("data", [])
        return {"texts": list(texts), "scores": [float(s) for s in outs["scores"]["data"]]}
    flat = [int(v) for v in outs["segments_samples"]["data"]]
    return {"segments": [flat[j:j + 2] for j in range(0, len(flat), 2)]}


async def v2_checks(base: str, model: str, name: str, kind: str, blobs: list[bytes]
                    ) -> list[dict[str, Any]]:
    """Each file once over V2, binary extension and base64 JSON: the outputs for comparison."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for i, blob in enumerate(blobs):
            for form, build in (("binary", v2_binary), ("base64", v2_base64)):
                body, headers = build(name, blob)
                async with session.post(f"{base}/v2/models/{model}/infer", data=body,
                                        headers=headers) as r:
                    raw = await r.read()
                    entry: dict[str, Any] = {"file": i, "form": form, "status": r.status}
                    if r.status == 200:
                        entry.update(v2_output(kind, raw, r.headers))
                    else:
                        entry["error"] = raw[:300].decode(errors="replace")
                    out.append(entry)
    return out


def mismatches(kind: str, calls: list[dict[str, Any]], reference: list[dict[str, Any]]
               ) -> dict[str, Any]:
    """Every answer against the package's own output for its file: OCR texts identical (and the
    largest score difference), VAD segments within one 512-sample frame."""
    bad: list[dict[str, Any]] = []
    score_diff = 0.0
    frame_diff = 0
    for c in calls:
        ref = reference[c["file"]]
        if c.get("status", 200) != 200:
            bad.append({"file": c["file"], "status": c["status"], "error": c.get("error")})
        elif kind == "ocr":
            if c["texts"] != ref["texts"]:
                bad.append({"file": c["file"], "got": c["texts"], "want": ref["texts"]})
            else:
                score_diff = max([score_diff, *(abs(a - b) for a, b in
                                                zip(c["scores"], ref["scores"], strict=True))])
        else:
            got, want = c["segments"], ref["segments"]
            diffs = [abs(a - b) for g, w in zip(got, want, strict=False)
                     for a, b in zip(g, w, strict=True)]
            if len(got) != len(want) or any(d > 512 for d in diffs):
                bad.append({"file": c["file"], "got": got, "want": want})
            frame_diff = max([frame_diff, *diffs])
    out: dict[str, Any] = {"answers": len(calls), "mismatched": len(bad), "examples": bad[:3]}
    if kind == "ocr":
        out["max_score_diff"] = score_diff
    else:
        out["max_boundary_diff_samples"] = frame_diff
    return out


def summarize(calls: list[dict[str, Any]], wall_s: float, units_per_file: list[float]
              ) -> dict[str, Any]:
    """Throughput (files/s and units/s: audio seconds for VAD), latency p50/p99, and each
    Server-Timing stage's p50/p99 and the rec batches seen (Sokuji only)."""
    ok = [c for c in calls if c.get("status", 200) == 200]
    ms = [c["ms"] for c in ok]
    out: dict[str, Any] = {
        "files": len(ok), "errors": len(calls) - len(ok), "wall_s": wall_s,
        "files_per_s": len(ok) / wall_s,
        "units_per_s": sum(units_per_file[c["file"]] for c in ok) / wall_s,
        "p50_ms": percentile(ms, 50) if ms else None, "p99_ms": percentile(ms, 99) if ms else None,
        "mean_ms": sum(ms) / len(ms) if ms else None}
    stages: dict[str, list[float]] = {}
    batches: Counter[str] = Counter()
    for c in ok:
        if c.get("stages_ms"):  # rapidocr's own split (in-process peer)
            for name, v in c["stages_ms"].items():
                stages.setdefault(name, []).append(v)
        for name, (dur, desc) in timing_entries(c.get("timing", "")).items():
            stages.setdefault(name, []).append(dur)
            if name in ("rec", "cls"):
                for size, reqs in BATCH_NOTE.findall(desc):
                    batches[f"{name} {size}x from {reqs}"] += 1
    out["stages"] = {n: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)}
                     for n, v in stages.items()}
    out["batches"] = dict(batches.most_common())
    return out


BATCH_METRIC = re.compile(r'^sokuji_media_batch_requests_(bucket|count|sum)\{([^}]*)\} (\S+)$')


async def batch_metrics(base: str) -> dict[str, dict[str, float]]:
    """Sokuji's ``sokuji_media_batch_requests`` histogram (per stage: how many requests shared
    a batch with each file, the most over its batches) as {stage: {le or count/sum: value}}."""
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        m = BATCH_METRIC.match(line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        key = labels.get("le", "") if m.group(1) == "bucket" else m.group(1)
        out.setdefault(labels.get("stage", "?"), {})[key] = float(m.group(3))
    return out


def batch_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
                ) -> dict[str, dict[str, float]]:
    """Over one run, per stage: files, the mean number of requests in a file's fullest batch,
    and the share of files that shared a batch with another request."""
    out = {}
    for stage, a in after.items():
        b = before.get(stage, {})
        count = a.get("count", 0) - b.get("count", 0)
        if count <= 0:
            continue
        alone = a.get("1.0", 0) - b.get("1.0", 0)
        out[stage] = {"files": count,
                      "mean_requests": (a.get("sum", 0) - b.get("sum", 0)) / count,
                      "shared_share": 1 - alone / count}
    return out
