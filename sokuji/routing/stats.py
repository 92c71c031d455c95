"""The few statistics routing decisions rest on, in pure Python (``math`` only): binomial
and hypergeometric tails, the one-sided Fisher exact test, Wilson and Clopper-Pearson
bounds. Exact for the small counts a canary window or a labelled pair set has; checked
against scipy in the tests (scipy is not a dependency of the server)."""

from __future__ import annotations

import math

Z95_TWO_SIDED = 1.959963984540054
Z95_ONE_SIDED = 1.6448536269514722


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    total = 0.0
    mode = (n + 1) * p
    for i in range(k, n + 1):
        term = math.exp(_log_comb(n, i) + i * lp + (n - i) * lq)
        total += term
        if i > mode and term < total * 1e-17:
            break  # past the mode the terms only shrink
    return min(1.0, total)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return 1.0 - binom_sf(k + 1, n, p) if k < n else 1.0


def fisher_greater(a: int, b: int, c: int, d: int) -> float:
    """One-sided Fisher exact test on the table [[a, b], [c, d]] (rows: canary, stable;
    columns: errors, successes): the probability, with the margins fixed, of at least ``a``
    errors in the first row. Small: the first row fails more often than the second."""
    n_row1, n_err, total = a + b, a + c, a + b + c + d
    if total == 0 or n_row1 == 0 or n_err == 0:
        return 1.0
    hi = min(n_row1, n_err)
    denom = _log_comb(total, n_row1)
    p = 0.0
    for x in range(a, hi + 1):
        p += math.exp(_log_comb(n_err, x) + _log_comb(total - n_err, n_row1 - x) - denom)
    return min(1.0, p)


def exceedance_log_pmf(x: int, n: int, m: int, r: int) -> float:
    """log P(X = x), X the number of ``n`` new samples above the ``r``-th largest of ``m``
    reference samples, all ``n + m`` from one distribution (exchangeable)."""
    if not 0 <= x <= n or not 1 <= r <= m:
        return -math.inf
    return (_log_comb(x + r - 1, x) + _log_comb(n - x + m - r, n - x)
            - _log_comb(n + m, n))


def exceedance_sf(x: int, n: int, m: int, r: int) -> float:
    """P(X >= x) for ``exceedance_log_pmf``'s X. Distribution-free, so exact when the
    threshold is itself estimated from the m reference samples (a Binomial(n, r / m) tail
    is not: it takes the estimate for the true quantile, and rejects too often)."""
    if x <= 0:
        return 1.0
    return min(1.0, sum(math.exp(exceedance_log_pmf(i, n, m, r)) for i in range(x, n + 1)))


def wilson(k: int, n: int, z: float = Z95_TWO_SIDED) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials ((0, 1) when n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    lo = 0.0 if k <= 0 else max(0.0, centre - half)
    hi = 1.0 if k >= n else min(1.0, centre + half)
    return lo, hi


def clopper_pearson_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact upper bound on a proportion after k events in n trials: the p at
    which P(X <= k) = 1 - confidence (bisection on the binomial tail)."""
    if n <= 0 or k >= n:
        return 1.0
    alpha = 1.0 - confidence
    lo, hi = k / n, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if binom_cdf(k, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided exact interval (each tail (1 - confidence) / 2)."""
    if n <= 0:
        return 0.0, 1.0
    tail = (1.0 + confidence) / 2
    upper = clopper_pearson_upper(k, n, tail)
    lower = 0.0 if k == 0 else 1.0 - clopper_pearson_upper(n - k, n, tail)
    return lower, upper


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
