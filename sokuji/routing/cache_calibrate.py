"""``sokuji cache calibrate``: the semantic cache's threshold from labelled pairs
(``data/cache_pairs.jsonl``, see ``data/CACHE_PAIRS.md``: positive = one answer is right for
both, negative = same topic, another answer), with a bound on its false-hit rate.

HR(t) = P(sim >= t and the guards pass | positive), FHR(t) = the same | negative. The chosen
t is **the lowest on a grid (step 1e-4) whose one-sided Clopper-Pearson upper bound of FHR(t)
is <= the target**: "FHR <= target at 95%" holds on these pairs, with the most hits that
allows. 0 false hits in n negatives bound FHR at 1 - 0.05^(1/n) ~ 3/n: a 2% target needs
>= 149 negatives, 1% >= 299. The share of hits that are wrong (GPTCache's figure) depends on
the share pi of lookups that meet a near-miss: pi*FHR / (pi*FHR + (1 - pi)*HR).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.core.semantic_cache import guard_ok
from sokuji.errors import ConfigError
from sokuji.routing.stats import clopper_pearson, clopper_pearson_upper, wilson

NEGATIVE_CATEGORIES = ("argument-swap", "negation-antonym", "entity-swap", "number-change",
                       "same-topic-different-question")
POSITIVE_CATEGORIES = ("synonym", "restructured", "register")
BUILTIN_PAIRS = Path(__file__).parent / "data" / "cache_pairs.jsonl"
RESOLUTION = 1e-4
FORMAT = 1
PLAIN: dict[str, Any] = {"markup": False, "highlight": False, "soft_wrap": True}


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    same: bool
    category: str


@dataclass(frozen=True)
class SweepRow:
    threshold: float
    hr: float
    fhr: float
    fhr_upper: float
    hits: int
    false_hits: int


@dataclass(frozen=True)
class CategoryRow:
    category: str
    same: bool
    n: int
    hits: int
    low: float
    high: float


@dataclass(frozen=True)
class Calibration:
    """threshold None: none meets the target with these negatives (``min_negatives`` are
    needed with 0 false hits). Intervals two-sided 95% (HR: Wilson; FHR: Clopper-Pearson);
    ``fhr_upper``: one-sided Clopper-Pearson at ``confidence``, the bound held to target."""

    threshold: float | None
    target_false_hit: float
    confidence: float
    guards: bool
    n_pos: int
    n_neg: int
    hits: int
    false_hits: int
    hr: float
    hr_interval: tuple[float, float]
    fhr: float
    fhr_interval: tuple[float, float]
    fhr_upper: float
    min_negatives: int
    embedder: str = ""
    data_sha256: str = ""
    per_category: tuple[CategoryRow, ...] = ()
    sweep: tuple[SweepRow, ...] = ()
    created: str = ""
    pairs: str = ""

    @property
    def feasible(self) -> bool:
        return self.threshold is not None

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Calibration:
        raw = {k: v for k, v in raw.items() if k != "format"}
        raw["hr_interval"] = tuple(raw["hr_interval"])
        raw["fhr_interval"] = tuple(raw["fhr_interval"])
        raw["per_category"] = tuple(CategoryRow(**r) for r in raw.get("per_category", ()))
        raw["sweep"] = tuple(SweepRow(**r) for r in raw.get("sweep", ()))
        return cls(**raw)


def load_pairs(path: str | Path = BUILTIN_PAIRS) -> list[Pair]:
    """The pairs of a JSONL file ({"a", "b", "same", "category"} a line), or ConfigError
    naming the line."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"pairs file {p}: {exc}", param="--pairs") from None
    pairs = []
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}:{no}: not JSON ({exc.msg})", param="--pairs") from None
        if (not isinstance(raw, dict) or set(raw) != {"a", "b", "same", "category"}
                or not isinstance(raw["same"], bool) or not all(
                    isinstance(raw[k], str) and raw[k].strip() for k in ("a", "b", "category"))):
            raise ConfigError(f"{p}:{no}: a line is {{\"a\": text, \"b\": text, \"same\": "
                              "true|false, \"category\": name}", param="--pairs")
        pairs.append(Pair(raw["a"], raw["b"], raw["same"], raw["category"]))
    if not any(x.same for x in pairs) or all(x.same for x in pairs):
        raise ConfigError(f"{p}: both positive and negative pairs are needed", param="--pairs")
    return pairs


def embed_pairs(encoder: Any, pairs: Sequence[Pair]) -> np.ndarray:
    """Cosine similarity of each pair (float64 [n]), each distinct text embedded once with
    ``encoder.embed(texts)`` (or ``encoder(texts)``: e.g. ``retrieval.builtin.
    minilm_embedder``) -> float [m, d]."""
    embed: Callable[[list[str]], np.ndarray] = getattr(encoder, "embed", encoder)
    texts = list(dict.fromkeys(t for x in pairs for t in (x.a, x.b)))
    vectors = np.asarray(embed(texts), dtype=np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    row = {t: i for i, t in enumerate(texts)}
    a, b = (vectors[[row[getattr(x, side)] for x in pairs]] for side in "ab")
    return np.einsum("ij,ij->i", a, b)


def guard_passes(pairs: Sequence[Pair]) -> np.ndarray:
    """Whether ``guard_ok`` lets each pair's second text hit the first (bool [n])."""
    return np.array([guard_ok(x.b, x.a) for x in pairs], dtype=bool)


def wrong_share(hr: float, fhr: float, mix: float) -> float:
    """Share of hits that are wrong when a fraction ``mix`` of lookups meet a near-miss."""
    wrong, right = mix * fhr, (1.0 - mix) * hr
    return wrong / (wrong + right) if wrong + right > 0 else 0.0


def min_negatives(target: float, confidence: float = 0.95) -> int:
    """The fewest negatives for which 0 false hits bounds FHR at ``target``."""
    return math.ceil(math.log(1.0 - confidence) / math.log1p(-target))


def _sorted_passing(sims: Iterable[float], passes: Any) -> tuple[np.ndarray, int]:
    s = np.asarray(list(sims), dtype=np.float64)
    keep = s if passes is None else s[np.asarray(passes, dtype=bool)]
    return np.sort(keep), len(s)


def _hits(sorted_sims: np.ndarray, t: np.ndarray | float) -> Any:
    return len(sorted_sims) - np.searchsorted(sorted_sims, t, side="left")


def calibrate(similarities_pos: Iterable[float], similarities_neg: Iterable[float],
              target_false_hit: float, confidence: float = 0.95,
              guard_pass_pos: Sequence[bool] | np.ndarray | None = None,
              guard_pass_neg: Sequence[bool] | np.ndarray | None = None, *,
              resolution: float = RESOLUTION) -> Calibration:
    """The lowest threshold on the grid whose one-sided Clopper-Pearson upper bound of the
    false-hit rate is <= ``target_false_hit`` (the module docstring). Guard results, when
    given, are per pair: a pair whose guard refuses is never a hit at any threshold."""
    if not 0.0 < target_false_hit < 1.0 or not 0.5 <= confidence < 1.0:
        raise ConfigError("target false-hit rate in (0, 1) and confidence in [0.5, 1) needed",
                          param="--target-false-hit")
    pos, n_pos = _sorted_passing(similarities_pos, guard_pass_pos)
    neg, n_neg = _sorted_passing(similarities_neg, guard_pass_neg)
    if n_pos == 0 or n_neg == 0:
        raise ConfigError("calibration needs positive and negative pairs", param="--pairs")
    k_max = next(k for k in range(n_neg + 1)  # the most false hits meeting the target
                 if clopper_pearson_upper(k, n_neg, confidence) > target_false_hit) - 1
    threshold: float | None = None
    if k_max >= 0:
        steps = round(1 / resolution)
        ts = np.round(np.arange(-steps, steps + 1) * resolution, 10)
        ok = _hits(neg, ts) <= k_max
        threshold = float(ts[int(np.argmax(ok))]) if ok.any() else None
    t = threshold if threshold is not None else math.inf
    hits, false_hits = int(_hits(pos, t)), int(_hits(neg, t))
    return Calibration(
        threshold=threshold, target_false_hit=target_false_hit, confidence=confidence,
        guards=guard_pass_pos is not None or guard_pass_neg is not None,
        n_pos=n_pos, n_neg=n_neg, hits=hits, false_hits=false_hits, hr=hits / n_pos,
        hr_interval=wilson(hits, n_pos), fhr=false_hits / n_neg,
        fhr_interval=clopper_pearson(false_hits, n_neg),
        fhr_upper=clopper_pearson_upper(false_hits, n_neg, confidence),
        min_negatives=min_negatives(target_false_hit, confidence))


def sweep(similarities_pos: Iterable[float], similarities_neg: Iterable[float],
          thresholds: Iterable[float] | None = None, confidence: float = 0.95,
          guard_pass_pos: Sequence[bool] | np.ndarray | None = None,
          guard_pass_neg: Sequence[bool] | np.ndarray | None = None) -> list[SweepRow]:
    """HR, FHR and FHR's one-sided upper bound at each threshold (default 0.70..0.99)."""
    pos, n_pos = _sorted_passing(similarities_pos, guard_pass_pos)
    neg, n_neg = _sorted_passing(similarities_neg, guard_pass_neg)
    ts = np.round(np.arange(70, 100) / 100, 2) if thresholds is None else thresholds
    rows = []
    for t in ts:
        h, f = int(_hits(pos, t)), int(_hits(neg, t))
        rows.append(SweepRow(float(t), h / max(n_pos, 1), f / max(n_neg, 1),
                             clopper_pearson_upper(f, n_neg, confidence), h, f))
    return rows


def per_category(pairs: Sequence[Pair], similarities: np.ndarray, threshold: float | None,
                 passes: np.ndarray | None = None) -> list[CategoryRow]:
    """Hit rate per category at ``threshold`` (false-hit rate for negatives' categories),
    two-sided 95%: Wilson for positives, Clopper-Pearson for negatives."""
    t = math.inf if threshold is None else threshold
    hit = np.asarray(similarities) >= t
    if passes is not None:
        hit &= np.asarray(passes, dtype=bool)
    rows = []
    for cat in dict.fromkeys(x.category for x in pairs):
        idx = [i for i, x in enumerate(pairs) if x.category == cat]
        n, k = len(idx), int(hit[idx].sum())
        same = pairs[idx[0]].same
        lo, hi = wilson(k, n) if same else clopper_pearson(k, n)
        rows.append(CategoryRow(cat, same, n, k, lo, hi))
    return rows


def default_path(cache_dir: str | Path, embedder: str, guards: bool) -> Path:
    """Where ``sokuji cache calibrate`` writes, and ``threshold = "calibrated"`` reads."""
    return (Path(cache_dir) / "calibration"
            / f"semantic-cache-{embedder}-{'guards' if guards else 'noguards'}.json")


def write(path: str | Path, calibration: Calibration) -> None:
    p, tmp = Path(path), Path(f"{path}.tmp")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(calibration.to_dict(), indent=1), encoding="utf-8")
    tmp.replace(p)


def read(path: str | Path) -> Calibration:
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, not {FORMAT}")
        return Calibration.from_dict(raw)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"semantic cache calibration {p}: {exc} (run `sokuji cache "
                          "calibrate`)", param="semantic_cache.threshold") from None


def calibrated_threshold(cache_dir: str | Path, embedder: str, guards: bool) -> float:
    """The threshold ``sokuji cache calibrate`` wrote for this embedder and guard setting."""
    cal = read(path := default_path(cache_dir, embedder, guards))
    if cal.embedder != embedder or cal.guards != guards or cal.threshold is None:
        raise ConfigError(f"{path}: embedder {cal.embedder!r}, guards={cal.guards}, threshold "
                          f"{cal.threshold}: run `sokuji cache calibrate`",
                          param="semantic_cache.threshold")
    return cal.threshold


def parser() -> argparse.ArgumentParser:
    c = argparse.ArgumentParser(prog="sokuji cache calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--pairs", default=str(BUILTIN_PAIRS),
                   help="JSONL of {a, b, same, category} (default: the built-in pairs)")
    c.add_argument("--target-false-hit", dest="target", type=float, default=0.02,
                   help="bound on the false-hit rate (one-sided, at --confidence)")
    c.add_argument("--confidence", type=float, default=0.95)
    c.add_argument("--embedder", choices=("minilm",), default="minilm")
    c.add_argument("--no-guards", dest="guards", action="store_false",
                   help="threshold alone (default: with the word-order and number guards)")
    c.add_argument("--mix", default="0.1,0.5",
                   help="share(s) of lookups meeting a near-miss, for the wrong share of hits")
    c.add_argument("--cache-dir", dest="cache_dir")
    c.add_argument("--out", help="JSON file (default: <cache_dir>/calibration/semantic-cache-"
                   "<embedder>-<guards|noguards>.json, read by threshold = \"calibrated\")")
    c.add_argument("--json", action="store_true", help="print the JSON instead of tables")
    return c


def run(pairs_path: str | Path, target: float, *, embed: Any, embedder: str,
        guards: bool = True, confidence: float = 0.95) -> Calibration:
    """Load, embed, calibrate, and attach the per-category rates and the sweep."""
    pairs = load_pairs(pairs_path)
    sims = embed_pairs(embed, pairs)
    passes = guard_passes(pairs) if guards else None
    same = np.array([x.same for x in pairs])
    gp, gn = (None, None) if passes is None else (passes[same], passes[~same])
    cal = calibrate(sims[same], sims[~same], target, confidence, gp, gn)
    return dataclasses.replace(
        cal, guards=guards, embedder=embedder,
        data_sha256=hashlib.sha256(Path(pairs_path).read_bytes()).hexdigest(),
        per_category=tuple(per_category(pairs, sims, cal.threshold, passes)),
        sweep=tuple(sweep(sims[same], sims[~same], None, confidence, gp, gn)),
        created=datetime.now(UTC).isoformat(timespec="seconds"), pairs=str(pairs_path))


def tables(cal: Calibration, mixes: Sequence[float]) -> list[Any]:
    from rich.table import Table

    guards = "on" if cal.guards else "off"
    t = Table(title=f"semantic cache sweep ({cal.embedder}, guards {guards}; {cal.n_pos} "
                    f"positives, {cal.n_neg} negatives)")
    for col in ("t", "HR", "hits", "FHR", "false hits", f"FHR {cal.confidence:.0%} upper",
                *(f"wrong share π={m:g}" for m in mixes)):
        t.add_column(col, justify="right")
    rows = list(cal.sweep)
    if cal.threshold is not None and all(r.threshold != cal.threshold for r in rows):
        rows.append(SweepRow(cal.threshold, cal.hr, cal.fhr, cal.fhr_upper, cal.hits,
                             cal.false_hits))
    for r in sorted(rows, key=lambda r: r.threshold):
        chosen = r.threshold == cal.threshold
        t.add_row(f"{r.threshold:.4f}" if chosen else f"{r.threshold:.2f}", f"{r.hr:.3f}",
                  str(r.hits), f"{r.fhr:.3f}", str(r.false_hits), f"{r.fhr_upper:.3f}",
                  *(f"{wrong_share(r.hr, r.fhr, m):.3f}" for m in mixes),
                  style="bold green" if chosen else None)
    c = Table(title=f"per category at t = {cal.threshold}")
    for col in ("category", "kind", "pairs", "hits", "rate", "95% interval"):
        c.add_column(col, justify="left" if col in ("category", "kind") else "right")
    for row in cal.per_category:
        c.add_row(row.category, "positive (HR)" if row.same else "negative (FHR)", str(row.n),
                  str(row.hits), f"{row.hits / row.n:.3f}", f"{row.low:.3f}-{row.high:.3f}")
    return [t, c]


def summary(cal: Calibration, mixes: Sequence[float]) -> str:
    if cal.threshold is None:
        return (f"no threshold bounds the false-hit rate at {cal.target_false_hit:g} with "
                f"{cal.n_neg} negatives (at least {cal.min_negatives} are needed)")
    (lo, hi), (flo, fhi) = cal.hr_interval, cal.fhr_interval
    wrong = ", ".join(f"{wrong_share(cal.hr, cal.fhr, m):.3f} at π={m:g}" for m in mixes)
    return (f"threshold {cal.threshold:.4f}: HR {cal.hr:.3f} ({lo:.3f}-{hi:.3f}), FHR "
            f"{cal.fhr:.3f} ({flo:.3f}-{fhi:.3f}; one-sided {cal.confidence:.0%} upper "
            f"{cal.fhr_upper:.4f} <= {cal.target_false_hit:g}); wrong share of hits {wrong}")


def main(argv: Sequence[str]) -> int:
    """``sokuji cache calibrate ...`` (``argv``: what follows ``calibrate``, which may be
    repeated first): 0 when a threshold meets the target, 1 when none does (too few
    negatives), 2 on bad arguments or data."""
    from rich.console import Console

    args = parser().parse_args(list(argv)[1:] if list(argv)[:1] == ["calibrate"] else argv)
    err = Console(stderr=True)
    try:
        mixes = [float(m) for m in args.mix.split(",") if m.strip()]
        if not all(0.0 <= m <= 1.0 for m in mixes) or not 0 < args.target < 1:
            raise ConfigError("--mix: shares in [0, 1]; --target-false-hit in (0, 1)")
        from sokuji import config as cfg
        from sokuji.retrieval.builtin import minilm_embedder

        cache_dir = cfg.load(overrides={"cache_dir": args.cache_dir}).cache_dir
        load_pairs(args.pairs)  # bad data fails before the model loads
        embed = minilm_embedder(cache_dir)
        cal = run(args.pairs, args.target, embed=embed, embedder=args.embedder,
                  guards=args.guards, confidence=args.confidence)
    except (ConfigError, ValueError) as exc:
        err.print(f"sokuji cache: {getattr(exc, 'message', exc)}", **PLAIN)
        return 2
    out_path = Path(args.out) if args.out else default_path(cache_dir, args.embedder,
                                                             args.guards)
    write(out_path, cal)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=1))
    else:
        out = Console() if sys.stdout.isatty() else Console(width=150)
        for table in tables(cal, mixes):
            out.print(table)
        out.print(summary(cal, mixes), **PLAIN)
    err.print(f"written: {out_path}", **PLAIN)
    return 0 if cal.feasible else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
