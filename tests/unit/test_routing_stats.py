"""sokuji/routing/stats.py (pure Python) against scipy on grids of small counts: the binomial
tails, the one-sided Fisher exact test, Clopper-Pearson from the beta quantiles, Wilson from
its defining quadratic and scipy's; the research doc's Wilson values. scipy is a test-only
dependency: skipped without it."""

from __future__ import annotations

import itertools
import math

import pytest

from sokuji.routing import stats

scipy_stats = pytest.importorskip("scipy.stats")

PS = (0.0, 1e-4, 0.001, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 0.999, 1.0)
NS = (*range(0, 13), 20, 33, 50, 100, 257)


def close(a: float, b: float, rel: float = 1e-9, abs_: float = 1e-12) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def test_binom_sf_and_cdf_match_scipy() -> None:
    bad = []
    for n, p in itertools.product(NS, PS):
        ks = sorted({*range(-1, min(n, 12) + 2), n // 2, n - 1, n, n + 1})
        for k in ks:
            want_sf = float(scipy_stats.binom.sf(k - 1, n, p))  # scipy's sf is P(X > k)
            want_cdf = float(scipy_stats.binom.cdf(k, n, p))
            got_sf, got_cdf = stats.binom_sf(k, n, p), stats.binom_cdf(k, n, p)
            if not close(got_sf, want_sf):
                bad.append(("sf", k, n, p, got_sf, want_sf))
            if not close(got_cdf, want_cdf, abs_=1e-12):
                bad.append(("cdf", k, n, p, got_cdf, want_cdf))
    assert not bad, bad[:10]


def test_binom_sf_keeps_small_tails_relatively_exact() -> None:
    """The canary's latency test compares tails like these with alpha = 0.001 or less."""
    for k, n in ((3, 3), (5, 50), (12, 500), (20, 1000), (40, 2000)):
        want = float(scipy_stats.binom.sf(k - 1, n, 0.01))
        assert close(stats.binom_sf(k, n, 0.01), want, rel=1e-9, abs_=0.0), (k, n)


def test_fisher_greater_matches_scipy_on_every_small_table() -> None:
    bad = []
    for a, b, c, d in itertools.product(range(7), repeat=4):
        want = float(scipy_stats.fisher_exact([[a, b], [c, d]], alternative="greater").pvalue)
        got = stats.fisher_greater(a, b, c, d)
        if not close(got, want, rel=1e-9, abs_=1e-12):
            bad.append(((a, b, c, d), got, want))
    assert not bad, bad[:10]


@pytest.mark.parametrize("table", [
    (1, 4, 2, 1998), (3, 0, 4, 396), (3, 30, 2, 755), (5, 45, 22, 1482), (14, 843, 4, 967),
    (0, 50, 10, 990), (50, 0, 0, 50), (2, 8, 2, 1998), (7, 194, 0, 185),
])
def test_fisher_greater_matches_scipy_on_canary_sized_tables(
        table: tuple[int, int, int, int]) -> None:
    a, b, c, d = table
    want = float(scipy_stats.fisher_exact([[a, b], [c, d]], alternative="greater").pvalue)
    assert close(stats.fisher_greater(a, b, c, d), want, rel=1e-9, abs_=1e-15)


def test_the_research_docs_fisher_example() -> None:
    # Stable 2/2000: one error in five canary requests already gives p ~ 0.0075.
    assert stats.fisher_greater(1, 4, 2, 1998) == pytest.approx(0.0075, abs=1e-4)


CONFIDENCES = (0.8, 0.9, 0.95, 0.99)


def test_clopper_pearson_matches_the_beta_quantiles() -> None:
    beta = scipy_stats.beta
    bad: list[tuple[object, ...]] = []
    for n in (*range(1, 13), 20, 50, 100):
        for k in sorted({*range(0, min(n, 12) + 1), n // 2, n - 1, n}):
            for conf in CONFIDENCES:
                want_up = 1.0 if k == n else float(beta.ppf(conf, k + 1, n - k))
                got_up = stats.clopper_pearson_upper(k, n, conf)
                if not close(got_up, want_up, rel=0.0, abs_=1e-9):
                    bad.append(("upper", k, n, conf, got_up, want_up))
                tail = (1 - conf) / 2
                want = (0.0 if k == 0 else float(beta.ppf(tail, k, n - k + 1)),
                        1.0 if k == n else float(beta.ppf(1 - tail, k + 1, n - k)))
                got = stats.clopper_pearson(k, n, conf)
                if not all(close(g, w, rel=0.0, abs_=1e-9) for g, w in zip(got, want,
                                                                            strict=True)):
                    bad.append(("two-sided", k, n, conf, got, want))
    assert not bad, bad[:10]


def test_clopper_pearson_matches_scipys_exact_interval() -> None:
    for k, n in ((0, 20), (1, 20), (5, 500), (19, 20), (20, 20)):
        ci = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
        got = stats.clopper_pearson(k, n, 0.95)
        assert got == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_wilson_bounds_solve_the_score_equation_and_match_scipy() -> None:
    z = stats.Z95_TWO_SIDED
    for n in (*range(1, 13), 20, 50, 100, 500, 10_000):
        for k in sorted({*range(0, min(n, 12) + 1), n // 3, n // 2, n - 1, n}):
            lo, hi = stats.wilson(k, n, z)
            phat = k / n
            # Each bound p0 satisfies (phat - p0)^2 = z^2 p0 (1 - p0) / n.
            for p0 in (lo, hi):
                assert (phat - p0) ** 2 == pytest.approx(z * z * p0 * (1 - p0) / n,
                                                         abs=1e-12), (k, n, p0)
            assert lo <= phat + 1e-15 and phat <= hi + 1e-15
            ci = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=0.95,
                                                           method="wilson")
            assert (lo, hi) == pytest.approx((ci.low, ci.high), abs=1e-12), (k, n)


def test_wilson_is_exactly_0_or_1_at_the_ends() -> None:
    ns = (1, 2, 3, 6, 7, 12, 20, 100)
    assert [stats.wilson(0, n)[0] for n in ns] == [0.0] * len(ns)
    assert [stats.wilson(n, n)[1] for n in ns] == [1.0] * len(ns)


@pytest.mark.parametrize(("k", "n", "want"), [
    (0, 20, (0.0, 0.161)), (1, 20, (0.009, 0.236)), (0, 100, (0.0, 0.037)),
    (5, 500, (0.004, 0.023)),
])
def test_wilson_known_values(k: int, n: int, want: tuple[float, float]) -> None:
    assert stats.wilson(k, n) == pytest.approx(want, abs=6e-4)


def test_empty_samples() -> None:
    assert stats.wilson(0, 0) == (0.0, 1.0)
    assert stats.clopper_pearson(0, 0) == (0.0, 1.0)
    assert stats.clopper_pearson_upper(0, 0) == 1.0
    assert stats.fisher_greater(0, 0, 0, 0) == 1.0
    assert stats.binom_sf(0, 0, 0.5) == 1.0 and stats.binom_sf(1, 0, 0.5) == 0.0


def test_normal_quantiles() -> None:
    assert math.isclose(stats.Z95_TWO_SIDED, scipy_stats.norm.ppf(0.975), abs_tol=1e-12)
    assert math.isclose(stats.Z95_ONE_SIDED, scipy_stats.norm.ppf(0.95), abs_tol=1e-12)
