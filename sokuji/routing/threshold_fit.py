"""Fitting a cascade's escalation threshold θ on a scored labelled set, the same for
classifiers (confidence: the margin, top-1 minus top-2 score) and generators (confidence: the
answer's mean token log-probability): an item below θ escalates to the large model. From the
small and large models' verdicts and the small one's confidences, every θ's accuracy,
escalation rate, compute cost and misroutes follow without running anything again
(``calibrate.py`` says how θ is chosen)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

BOOTSTRAP = 1000


@dataclass(frozen=True)
class Scored:
    """Both classifiers' verdicts on a labelled set."""

    small_ok: np.ndarray
    large_ok: np.ndarray
    margin: np.ndarray


@dataclass(frozen=True)
class Row:
    threshold: float
    escalated: float
    accuracy: float
    of_large: float
    cost_of_large: float
    easy_escalated: int
    hard_kept: int


def row(sc: Scored, theta: float, cost_ratio: float) -> Row:
    esc = sc.margin < theta
    ok = np.where(esc, sc.large_ok, sc.small_ok)
    acc_l = float(sc.large_ok.mean()) or 1.0
    return Row(theta, float(esc.mean()), float(ok.mean()), float(ok.mean()) / acc_l,
               cost_ratio + float(esc.mean()),
               int((esc & sc.small_ok).sum()), int((~esc & ~sc.small_ok & sc.large_ok).sum()))


def candidates(sc: Scored) -> np.ndarray:
    """Every θ that changes the outcome: the lowest (never escalate: 0 for margins, -inf for
    log-probabilities), each distinct margin nudged up (escalate it and every lower one), and
    above the largest (always)."""
    ms = np.unique(sc.margin)
    floor = 0.0 if not len(ms) or ms[0] >= 0 else -np.inf
    return np.concatenate([[floor], np.nextafter(ms, np.inf).astype(np.float64)])


def fit_escalation(sc: Scored, rate: float) -> float:
    """θ such that the share ``rate`` of queries with the lowest margins escalates."""
    ms = np.sort(sc.margin)
    k = round(rate * len(ms))
    if k <= 0:
        return 0.0
    return float(np.nextafter(ms[min(k, len(ms)) - 1], np.inf))


def fit_quality(sc: Scored, quality: float, seed: int = 0) -> tuple[float, float]:
    """The smallest θ whose bootstrap 5th percentile of acc(θ) / acc_large is >= quality;
    returns (θ, that lower bound)."""
    rng = np.random.default_rng(seed)
    n = len(sc.margin)
    idx = rng.integers(0, n, size=(BOOTSTRAP, n))
    large = sc.large_ok[idx].mean(axis=1)
    large = np.where(large > 0, large, 1.0)
    best = (float(candidates(sc)[-1]), 0.0)
    for theta in candidates(sc):
        ok = np.where(sc.margin < theta, sc.large_ok, sc.small_ok)
        low = float(np.quantile(ok[idx].mean(axis=1) / large, 0.05))
        if low >= quality:
            return float(theta), low
        best = (float(theta), low) if low > best[1] else best
    return best


def table(rows: Sequence[Row], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col in ("θ", "escalated", "accuracy", "÷ large", "cost ÷ large", "easy escalated",
                "hard kept"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r.threshold:.4f}", f"{r.escalated:.1%}", f"{r.accuracy:.3f}",
                  f"{r.of_large:.3f}", f"{r.cost_of_large:.3f}", str(r.easy_escalated),
                  str(r.hard_kept))
    return t


def held_out(sc: Scored, theta: float, cost_ratio: float) -> dict[str, Any]:
    """The chosen θ on a held-out set (``--test``)."""
    return {**asdict(row(sc, theta, cost_ratio)), "n": len(sc.margin),
            "small_accuracy": float(sc.small_ok.mean()),
            "large_accuracy": float(sc.large_ok.mean())}


def save(result: dict[str, Any], out: Path, as_json: bool) -> bool:
    """Write the result where the router reads it; print it too with ``--json`` (True:
    printed, nothing more to show)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result, indent=2))
    return as_json
