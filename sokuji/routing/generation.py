"""`sokuji route calibrate` for a cascade of two generators: both answer every question of a
labelled set (``{"text", "answers"}``: short factual or arithmetic questions), greedy, up to
``--max-tokens``; the small one with its tokens' log-probabilities, whose mean is its
confidence. An answer is right when one of the accepted answers appears in it as a whole word
(case-insensitive). Then the threshold is fitted, swept and reported exactly as a
classifier cascade's (``calibrate.py``: escalate below θ; accuracy, cost and misroutes per θ),
the cost being each generator's measured seconds per answer.

The two models are loaded in this process from the server's config (nothing else of it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import time
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


def read_questions(path: str | Path) -> tuple[list[str], list[list[str]]]:
    texts, answers = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            doc = json.loads(line)
            texts.append(doc["text"])
            accepted = doc.get("answers", doc.get("label"))
            answers.append([accepted] if isinstance(accepted, str) else list(accepted))
    return texts, answers


def is_right(text: str, accepted: list[str]) -> bool:
    """One of the accepted answers appears in ``text`` as a whole word (or number)."""
    low = text.lower()
    return any(re.search(r"(?<![\w])" + re.escape(a.lower()) + r"(?![\w])", low)
               for a in accepted)


async def _answer(served: Any, question: str, max_tokens: int) -> tuple[str, float, float]:
    """(text, mean token log-probability, seconds) of one greedy answer."""
    from sokuji.core.events import Delta, Finish
    from sokuji.core.model import GenerationInput, RequestContext
    from sokuji.core.request import Priority

    inputs = GenerationInput(chat=True, messages=[{"role": "user", "content": question}],
                             prompt=None, max_tokens=max_tokens, max_tokens_field="max_tokens",
                             min_tokens=0, ignore_eos=False, temperature=0.0, top_p=1.0,
                             stop=(), seed=None, logprobs=0)
    t0 = time.perf_counter()
    ctx = RequestContext("calibrate", Priority.INTERACTIVE, None, time.perf_counter_ns())
    gen = served.submit(await served.prepare(inputs, ctx), ctx)
    texts: list[str] = []
    logprobs: list[float] = []
    while True:
        events = await gen.next_events()
        for e in events:
            if isinstance(e, Delta):
                texts.append(e.text)
                logprobs.extend(lp.logprob for lp in e.logprobs)
        if isinstance(events[-1], Finish):
            if events[-1].error is not None:
                raise events[-1].error
            break
    mean = sum(logprobs) / len(logprobs) if logprobs else float("-inf")
    return "".join(texts), mean, time.perf_counter() - t0


async def _score(config: Any, names: tuple[str, ...], texts: list[str],
                 answers: list[list[str]], max_tokens: int, console: Any
                 ) -> tuple[Scored, float, float, list[dict[str, Any]]]:
    from sokuji.repository.models import ModelRepository

    repo = ModelRepository.load(config)
    repo.start()
    try:
        small, large = (repo.models[n].served for n in names)
        rows: list[dict[str, Any]] = []
        s_ok, l_ok, conf, s_time, l_time = [], [], [], [], []
        with console.status(f"answering {len(texts)} questions with both generators"):
            for text, accepted in zip(texts, answers, strict=True):
                s_text, mean, s_s = await _answer(small, text, max_tokens)
                l_text, _, l_s = await _answer(large, text, max_tokens)
                s_ok.append(is_right(s_text, accepted))
                l_ok.append(is_right(l_text, accepted))
                conf.append(mean)
                s_time.append(s_s)
                l_time.append(l_s)
                rows.append({"question": text, "small": s_text, "large": l_text,
                             "confidence": mean, "small_ok": s_ok[-1], "large_ok": l_ok[-1]})
    finally:
        await repo.stop()
    sc = Scored(np.asarray(s_ok), np.asarray(l_ok), np.asarray(conf, dtype=np.float64))
    return sc, float(np.median(s_time)), float(np.median(l_time)), rows


def calibrate_generation(args: argparse.Namespace, config: Any, opts: Any, console: Any) -> int:
    import msgspec

    from sokuji import config as cfg
    from sokuji.routing.router import calibration_path

    targets = tuple(opts.targets)
    only = cfg.validate(msgspec.structs.replace(
        config, models=tuple(m for m in config.models if m.name in targets), pipelines=(),
        builtin_pipelines=False, api_keys=()))
    texts, answers = read_questions(args.labelled)
    sc, c_s, c_l, answered = asyncio.run(_score(only, targets, texts, answers,
                                                args.max_tokens, console))
    ratio = c_s / c_l if c_l else 1.0
    if args.target_escalation is not None:
        theta, rule, bound = fit_escalation(sc, args.target_escalation), \
            f"escalation {args.target_escalation}", None
    else:
        theta, bound = fit_quality(sc, args.target_quality)
        rule = f"quality {args.target_quality}"
    finite = sc.margin[np.isfinite(sc.margin)]
    sweep_at = sorted({float("-inf"), *(float(np.quantile(finite, q)) for q in
                                        (0.1, 0.25, 0.5, 0.75, 0.9) if len(finite)), 0.0})
    sweep = [row(sc, t, ratio) for t in sweep_at]
    chosen = row(sc, theta, ratio)
    result: dict[str, Any] = {
        "router": args.router, "kind": "generation", "threshold": theta, "rule": rule,
        "bootstrap_low": bound, "small": targets[0], "large": targets[1],
        "small_accuracy": float(sc.small_ok.mean()), "large_accuracy": float(sc.large_ok.mean()),
        "small_ms": c_s * 1e3, "large_ms": c_l * 1e3, "calibration": asdict(chosen),
        "labelled": str(args.labelled), "labelled_sha256": hashlib.sha256(
            Path(args.labelled).read_bytes()).hexdigest(), "n": len(texts),
        "max_tokens": args.max_tokens, "answers": answered}
    if args.test:
        t_texts, t_answers = read_questions(args.test)
        tsc, _, _, _ = asyncio.run(_score(only, targets, t_texts, t_answers, args.max_tokens,
                                          console))
        result["test"] = held_out(tsc, theta, ratio)
    out = Path(args.out) if args.out else calibration_path(config.cache_dir, args.router)
    if save(result, out, args.json):
        return 0
    console.print(table(sweep, f"{args.router}: {len(texts)} questions (small "
                        f"{sc.small_ok.mean():.3f}, large {sc.large_ok.mean():.3f} right; "
                        f"{c_s * 1e3:.0f} vs {c_l * 1e3:.0f} ms an answer); θ: mean token "
                        "log-probability"))
    console.print(table([chosen], f"chosen by {rule}: θ = {theta:.4f}"))
    if args.test:
        t = result["test"]
        console.print(f"held-out test ({t['n']}): accuracy {t['accuracy']:.3f} = "
                      f"{t['of_large']:.3f} of large, cost {t['cost_of_large']:.3f} of large, "
                      f"escalated {t['escalated']:.1%}")
    console.print(f"written: {out}")
    return 0
