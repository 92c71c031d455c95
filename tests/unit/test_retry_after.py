"""The one Retry-After parser (sokuji/core/retry_after.py): delay-seconds, the three forms
of an HTTP-date (always GMT), a cap, and everything else refused."""

from __future__ import annotations

import email.utils
import time
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from sokuji.core.retry_after import MAX_S, http_date, parse_retry_after

NOW = 1_800_000_000.0


@pytest.mark.parametrize(("header", "expected"), [
    ("120", 120),
    (" 7 ", 7),
    ("0", 0),
    (format_datetime(datetime.fromtimestamp(NOW + 30, UTC), usegmt=True), 30),
    (format_datetime(datetime.fromtimestamp(NOW - 30, UTC), usegmt=True), 0),
    ("-5", None),
    ("1.5", None),
    ("soon", None),
    ("", None),
    (None, None),
    ("Wed, 99 Foo 2026 25:61:00 GMT", None),
    ("٣", None),  # a non-ASCII digit is not delay-seconds
])
def test_parse_retry_after(header: str | None, expected: int | None) -> None:
    assert parse_retry_after(header, now=NOW) == expected


def test_retry_after_parsing() -> None:
    now = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC).timestamp()
    assert parse_retry_after("7") == 7 and parse_retry_after(" 120 ") == 120
    assert parse_retry_after("99999999") == 3600  # capped
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), now) == 30
    assert parse_retry_after("Tue, 01 Dec 2026 11:00:00 GMT", now) == 0  # in the past
    assert parse_retry_after("Wed, 02 Dec 2026 12:00:00 GMT", now) == 3600
    for garbage in (None, "", "-5", "1.5", "soon", "٣", "Mon, 99 Foo 2026"):
        assert parse_retry_after(garbage, now) is None


def test_whole_seconds_and_a_bound() -> None:
    assert isinstance(parse_retry_after("30"), int)
    assert parse_retry_after("9" * 5000) == MAX_S  # not parsed as a 5000-digit number
    assert parse_retry_after(str(MAX_S + 1)) == MAX_S
    assert parse_retry_after(format_datetime(
        datetime.fromtimestamp(NOW + 10.2, UTC), usegmt=True), NOW + 0.5) == 10  # rounded up
    assert parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT", NOW) == MAX_S


def test_the_three_forms_of_an_http_date() -> None:
    """RFC 9110 §5.6.7's example, in each form: the same instant."""
    t = datetime(1994, 11, 6, 8, 49, 37, tzinfo=UTC).timestamp()
    assert http_date("Sun, 06 Nov 1994 08:49:37 GMT", NOW) == t
    assert http_date("Sunday, 06-Nov-94 08:49:37 GMT", NOW) == t
    assert http_date("Sun Nov  6 08:49:37 1994", NOW) == t
    assert http_date("Sun Nov 16 08:49:37 1994", NOW) == t + 10 * 86400
    assert http_date("Wed, 31 Dec 2008 23:59:60 GMT", NOW) == \
        datetime(2009, 1, 1, tzinfo=UTC).timestamp()  # a leap second


def test_an_rfc850_year_is_at_most_50_years_ahead() -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC).timestamp()

    def year(yy: str) -> int:
        when = http_date(f"Monday, 01-Jan-{yy} 00:00:00 GMT", now)
        assert when is not None
        return time.gmtime(when).tm_year

    assert (year("26"), year("76"), year("77"), year("94"), year("00")) == \
        (2026, 2076, 1977, 1994, 2000)


@pytest.mark.parametrize("text", [
    "Sun, 06 Nov 1994 08:49:37",          # no zone: not an HTTP-date (it is always GMT)
    "Sun, 06 Nov 1994 08:49:37 +0000",    # RFC 5322's numeric zone
    "Sun, 06 Nov 1994 10:49:37 +0200",
    "Sun, 06 Nov 1994 08:49:37 UTC",
    "Sun, 06 Nov 1994 08:49:37 gmt",      # case-sensitive
    "sun, 06 Nov 1994 08:49:37 GMT",
    "Sun, 06 nov 1994 08:49:37 GMT",
    "Sun, 6 Nov 1994 08:49:37 GMT",       # IMF-fixdate's day has two digits
    "Sun, 06 Nov 94 08:49:37 GMT",
    "Sunday, 06 Nov 1994 08:49:37 GMT",
    "Sun, 06-Nov-94 08:49:37 GMT",        # RFC 850 names the whole day
    "Sun Nov  6 08:49:37 1994 GMT",
    "Sun, 31 Feb 1994 08:49:37 GMT",      # no such day
    "Sun, 06 Nov 1994 24:00:00 GMT",
    "Sun, 06 Nov 1994 08:49:61 GMT",
    "Sun, 06 Nov 0000 08:49:37 GMT",
    "Sun,  06 Nov 1994 08:49:37 GMT",
    "1994-11-06T08:49:37Z",
])
def test_what_is_not_an_http_date_is_refused(text: str) -> None:
    assert http_date(text, NOW) is None
    assert parse_retry_after(text, NOW) is None
