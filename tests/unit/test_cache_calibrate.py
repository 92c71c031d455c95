"""The semantic cache's calibration (sokuji/routing/cache_calibrate.py): the lowest threshold
meeting a Clopper-Pearson bound, checked against brute force; the file; the labelled pairs'
hygiene; and, with the real MiniLM, that the cache's hits on the pairs are the ones the
calibration counts."""

from __future__ import annotations

import dataclasses
import json
import math
import unicodedata
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from sokuji.core.semantic_cache import SemanticCache
from sokuji.errors import ConfigError
from sokuji.routing import cache_calibrate as cc
from sokuji.routing.stats import clopper_pearson_upper
from tests.conftest import CACHE_DIR


def brute_force(pos: np.ndarray, neg: np.ndarray, gp: np.ndarray, gn: np.ndarray,
                target: float, resolution: float) -> float | None:
    bound: dict[int, float] = {}
    steps = round(1 / resolution)
    for j in range(-steps, steps + 1):
        t = round(j * resolution, 10)
        k = int(((neg >= t) & gn).sum())
        if k not in bound:
            bound[k] = clopper_pearson_upper(k, len(neg), 0.95)
        if bound[k] <= target:
            return t
    return None


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("target", [0.02, 0.05, 0.1])
@pytest.mark.parametrize("guards", [False, True])
def test_lowest_threshold_meeting_the_bound_equals_brute_force(seed: int, target: float,
                                                                guards: bool) -> None:
    rng = np.random.default_rng(seed)
    pos = np.clip(rng.normal(0.85, 0.08, 150), -1, 0.999)
    neg = np.clip(rng.normal(0.70, 0.12, 200), -1, 0.999)
    gp = rng.random(150) < 0.95 if guards else np.ones(150, bool)
    gn = rng.random(200) < 0.7 if guards else np.ones(200, bool)
    cal = cc.calibrate(pos, neg, target, 0.95, gp if guards else None, gn if guards else None,
                       resolution=0.01)
    expected = brute_force(pos, neg, gp, gn, target, 0.01)
    assert cal.threshold == pytest.approx(expected)
    assert cal.threshold is not None and cal.guards == guards
    k = int(((neg >= cal.threshold) & gn).sum())
    assert cal.false_hits == k and cal.fhr_upper <= target
    assert cal.hits == int(((pos >= cal.threshold) & gp).sum())
    below = int(((neg >= cal.threshold - 0.01) & gn).sum())  # one step lower breaks the bound
    assert clopper_pearson_upper(below, 200) > target
    assert cal.n_pos == 150 and cal.n_neg == 200 and cal.hr == cal.hits / 150


def test_zero_false_hits_bound_is_about_three_over_n() -> None:
    rng = np.random.default_rng(3)
    neg = rng.uniform(0.0, 0.5, 300)
    pos = rng.uniform(0.3, 1.0, 300)
    cal = cc.calibrate(pos, neg, 0.01)
    assert cal.false_hits == 0 and cal.threshold is not None
    assert cal.threshold == pytest.approx(math.ceil(neg.max() / 1e-4 + 1e-9) * 1e-4)
    assert cal.fhr_upper == pytest.approx(1 - 0.05 ** (1 / 300), rel=1e-6)
    assert cal.fhr_upper == pytest.approx(3 / 300, rel=0.01)
    assert cal.min_negatives == 299 and cc.min_negatives(0.02) == 149
    too_few = cc.calibrate(pos, neg[:100], 0.02)  # 100 < 149: no threshold can claim 2%
    assert not too_few.feasible and too_few.hits == 0 and too_few.min_negatives == 149
    with pytest.raises(ConfigError):
        cc.calibrate(pos, neg, 0.0)


def test_sweep_rows_and_wrong_share() -> None:
    pos = np.array([0.99, 0.95, 0.91, 0.80])
    neg = np.array([0.97, 0.90, 0.60])
    rows = cc.sweep(pos, neg, [0.9, 0.95], guard_pass_neg=[False, True, True])
    assert [(r.threshold, r.hits, r.false_hits) for r in rows] == [(0.9, 3, 1), (0.95, 2, 0)]
    assert rows[0].hr == 0.75 and rows[0].fhr == pytest.approx(1 / 3)
    assert rows[1].fhr_upper == pytest.approx(clopper_pearson_upper(0, 3))
    assert len(cc.sweep(pos, neg)) == 30  # 0.70 .. 0.99
    assert cc.wrong_share(0.5, 0.05, 0.5) == pytest.approx(0.025 / 0.275)
    assert cc.wrong_share(0.0, 0.0, 0.5) == 0.0


def test_per_category_rates() -> None:
    pairs = [cc.Pair("a", "b", False, "argument-swap"), cc.Pair("c", "d", False,
             "argument-swap"), cc.Pair("e", "f", True, "synonym")]
    rows = cc.per_category(pairs, np.array([0.99, 0.5, 0.95]), 0.9,
                           np.array([False, True, True]))
    assert [(r.category, r.same, r.n, r.hits) for r in rows] == [
        ("argument-swap", False, 2, 0), ("synonym", True, 1, 1)]


def test_write_read_and_the_calibrated_threshold(tmp_path: Path) -> None:
    cal = cc.calibrate([0.99, 0.9], np.linspace(0, 0.5, 200), 0.05, 0.95, [True, True],
                       [True] * 200)
    cal = dataclasses.replace(
        cal, embedder="minilm", data_sha256="ab" * 32, per_category=(cc.CategoryRow(
            "synonym", True, 2, 2, 0.3, 1.0),), sweep=tuple(cc.sweep([0.99], [0.1])))
    path = cc.default_path(tmp_path, "minilm", guards=True)
    cc.write(path, cal)
    assert cc.read(path) == cal
    assert cc.calibrated_threshold(tmp_path, "minilm", True) == cal.threshold
    with pytest.raises(ConfigError, match="sokuji cache calibrate"):
        cc.calibrated_threshold(tmp_path, "minilm", False)  # no such file
    cc.write(cc.default_path(tmp_path, "mpnet", True), cal)  # the wrong embedder inside
    with pytest.raises(ConfigError, match="embedder 'minilm'"):
        cc.calibrated_threshold(tmp_path, "mpnet", True)
    path.write_text(json.dumps({"format": 99}))
    with pytest.raises(ConfigError, match="format"):
        cc.read(path)


def test_load_pairs_names_the_bad_line(tmp_path: Path) -> None:
    good = '{"a": "x", "b": "y", "same": true, "category": "synonym"}\n'
    neg = '{"a": "x", "b": "z", "same": false, "category": "entity-swap"}\n'
    for body, where in ((good + neg + "{oops\n", ":3:"), (good + '{"a": "x", "b": "y"}\n', ":2:"),
                        (good + '{"a": "", "b": "y", "same": true, "category": "c"}\n', ":2:"),
                        (good + '{"a": "x", "b": "y", "same": "yes", "category": "c"}\n', ":2:"),
                        (good + good, "both positive and negative")):
        f = tmp_path / "p.jsonl"
        f.write_text(body)
        with pytest.raises(ConfigError, match=where):
            cc.load_pairs(f)
    f.write_text(good + "\n" + neg)
    assert cc.load_pairs(f) == [cc.Pair("x", "y", True, "synonym"),
                                cc.Pair("x", "z", False, "entity-swap")]


def test_builtin_pairs_hygiene() -> None:
    pairs = cc.load_pairs()
    counts = Counter(p.category for p in pairs)
    assert sum(p.same for p in pairs) >= 300 and sum(not p.same for p in pairs) >= 300
    assert set(counts) == set(cc.NEGATIVE_CATEGORIES) | set(cc.POSITIVE_CATEGORIES)
    for kind, cats in ((False, cc.NEGATIVE_CATEGORIES), (True, cc.POSITIVE_CATEGORIES)):
        assert all(p.same == kind for p in pairs if p.category in cats)
        sizes = [counts[c] for c in cats]
        assert min(sizes) >= 60 and max(sizes) <= 1.25 * min(sizes)  # balanced-ish

    def norm(s: str) -> str:
        return " ".join(unicodedata.normalize("NFC", s).casefold().split())

    keys = [frozenset((norm(p.a), norm(p.b))) for p in pairs]
    assert len(set(keys)) == len(keys), [k for k, n in Counter(keys).items() if n > 1]
    assert all(norm(p.a) != norm(p.b) and len(p.a) < 200 and len(p.b) < 200 for p in pairs)


@pytest.fixture(scope="module")
def embed() -> Callable[[list[str]], np.ndarray]:
    from sokuji.retrieval.builtin import minilm_embedder

    return minilm_embedder(CACHE_DIR, intra_op_threads=1)


def test_cache_hits_on_the_pairs_are_what_calibration_counts(
        embed: Callable[[list[str]], np.ndarray]) -> None:
    """Real MiniLM on the built-in pairs: each pair's first text stored in a scope of its
    own, the second looked up; hits and false hits equal the calibration's at its
    threshold, with and without guards."""
    pairs = cc.load_pairs()
    texts = list(dict.fromkeys(t for p in pairs for t in (p.a, p.b)))
    vectors = dict(zip(texts, embed(texts), strict=True))
    for guards in (True, False):
        cal = cc.run(cc.BUILTIN_PAIRS, 0.05, embed=lambda ts: np.stack([vectors[t] for t in ts]),
                     embedder="minilm", guards=guards)
        assert cal.threshold is not None and cal.fhr_upper <= 0.05
        cache = SemanticCache(cal.threshold, guards=guards, max_entries=len(pairs))
        hits: Counter[bool] = Counter()
        for i, p in enumerate(pairs):
            scope = ("t", "m", "1", str(i))
            cache.store(scope, p.a, vectors[p.a], i, 0)
            _, sim, result = cache.lookup(scope, p.b, vectors[p.b])
            assert sim == pytest.approx(float(vectors[p.a] @ vectors[p.b]), abs=1e-5)
            hits[p.same] += result == "hit"
        assert (hits[True], hits[False]) == (cal.hits, cal.false_hits)
        assert sum(r.hits for r in cal.per_category if r.same) == cal.hits


def test_cli_writes_json_and_says_when_no_threshold_can_be_claimed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = tmp_path / "pairs.jsonl"
    lines = cc.BUILTIN_PAIRS.read_text().splitlines()
    small.write_text("\n".join(lines[:12] + lines[-12:]) + "\n")  # 12 negatives, 12 positives
    out = tmp_path / "cal.json"
    common = ["--pairs", str(small), "--cache-dir", str(CACHE_DIR), "--out", str(out)]
    from sokuji.cli import main as sokuji_main

    assert sokuji_main(["cache", "calibrate", *common, "--target-false-hit", "0.3",
                        "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    cal = cc.read(out)
    assert cc.Calibration.from_dict(printed) == cal
    assert cal.n_neg == 12 and cal.threshold is not None
    assert cal.embedder == "minilm" and cal.guards and len(cal.data_sha256) == 64
    assert cc.main(["calibrate", *common, "--target-false-hit", "0.02", "--no-guards"]) == 1
    assert "at least 149" in capsys.readouterr().out
    assert not cc.read(out).feasible and not cc.read(out).guards
    small.write_text("not json\n")
    assert cc.main(common) == 2
    assert "pairs.jsonl:1" in capsys.readouterr().err
