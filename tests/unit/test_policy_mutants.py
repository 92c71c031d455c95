"""Deadline admission (``core/policy.py`` ``check_deadline``) at its boundaries, against the
mutants mutmut left alive there (docs/mutation.md): each test names the mutant(s) it kills,
by mutmut's name."""

from __future__ import annotations

import pytest

from sokuji.core.policy import check_deadline
from sokuji.errors import DeadlineExceeded

NOW_NS = 5_000_000_000
MS = 1_000_000


def test_a_deadline_reached_exactly_now_is_refused_with_its_reason() -> None:
    """Kills ``x_check_deadline__mutmut_6`` (``< 0``: a request with no time left queued)
    and ``_8``, ``_9``, ``_10`` (the reason lost or changed)."""
    with pytest.raises(DeadlineExceeded) as e:
        check_deadline(NOW_NS, NOW_NS, 0.0, 0.0, False)
    assert e.value.message == "the request's deadline passed before it was queued"


def test_half_a_millisecond_left_is_still_time() -> None:
    """Kills ``x_check_deadline__mutmut_7`` (``<= 1``: under a millisecond left refused)."""
    check_deadline(NOW_NS + MS // 2, NOW_NS, 0.0, 0.0, False)


def test_work_ahead_that_drains_exactly_in_the_time_left_is_admitted() -> None:
    """100 items ahead at 1000 items/s drain in exactly 100 ms, the time left: admitted; one
    millisecond less is refused. Kills ``x_check_deadline__mutmut_5`` (ns -> ms by 1000001),
    ``_16`` (work times rate), ``_17`` (s -> ms by 1001) and ``_18`` (``>=``), each of which
    refuses the first."""
    check_deadline(NOW_NS + 100 * MS, NOW_NS, 100.0, 1000.0, True)
    with pytest.raises(DeadlineExceeded):
        check_deadline(NOW_NS + 99 * MS, NOW_NS, 100.0, 1000.0, True)
