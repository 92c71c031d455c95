"""The ``Retry-After`` header as whole seconds to wait (RFC 9110 §10.2.3).

Its value is delay-seconds (``1*DIGIT``) or an HTTP-date (§5.6.7): the IMF-fixdate
``Sun, 06 Nov 1994 08:49:37 GMT``, or one of the obsolete forms a recipient must still read,
RFC 850's ``Sunday, 06-Nov-94 08:49:37 GMT`` and asctime's ``Sun Nov  6 08:49:37 1994``.
An HTTP-date is always GMT: a date with another zone, or none where its form has one, is
not an HTTP-date and is refused like any other malformed value. Names of days and months
and ``GMT`` are case-sensitive, as the grammar says.
"""

from __future__ import annotations

import calendar
import math
import re
import time

MAX_S = 3600
"""The longest wait believed: a larger value (or a date further away) counts as this."""

_DELAY = re.compile(r"[0-9]+")
_DAYS = "Mon|Tue|Wed|Thu|Fri|Sat|Sun"
_LONG_DAYS = "Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday"
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov",
           "Dec")
_MONTH = "|".join(_MONTHS)
_TIME = r"(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})"
_IMF_FIXDATE = re.compile(
    rf"(?:{_DAYS}), (?P<day>[0-9]{{2}}) (?P<month>{_MONTH}) (?P<year>[0-9]{{4}}) {_TIME} GMT")
_RFC850 = re.compile(
    rf"(?:{_LONG_DAYS}), (?P<day>[0-9]{{2}})-(?P<month>{_MONTH})-(?P<yy>[0-9]{{2}}) {_TIME} GMT")
_ASCTIME = re.compile(
    rf"(?:{_DAYS}) (?P<month>{_MONTH}) (?P<day>[0-9]{{2}}| [0-9]) {_TIME} (?P<year>[0-9]{{4}})")


def parse_retry_after(value: str | None, now: float | None = None) -> int | None:
    """Whole seconds to wait, from 0 (a date in the past) to ``MAX_S``; None when there is
    no value or it is neither delay-seconds nor an HTTP-date (a negative or fractional
    number, another date format, another zone). ``now``: the wall clock
    (``time.time()``), which a date is counted from."""
    if value is None:
        return None
    text = value.strip()
    if _DELAY.fullmatch(text):
        return MAX_S if len(text) > len(str(MAX_S)) else min(int(text), MAX_S)
    current = time.time() if now is None else now
    when = http_date(text, current)
    if when is None:
        return None
    return min(max(0, math.ceil(when - current)), MAX_S)


def http_date(text: str, now: float) -> float | None:
    """An HTTP-date as Unix seconds; None if ``text`` is not one (or names no real time).
    ``now`` places an RFC 850 two-digit year: more than 50 years ahead of it means the
    century before (RFC 9110 §5.6.7)."""
    if m := _IMF_FIXDATE.fullmatch(text) or _ASCTIME.fullmatch(text):
        year = int(m["year"])
    elif m := _RFC850.fullmatch(text):  # the latest such year at most 50 years ahead
        latest = time.gmtime(now).tm_year + 50
        year = latest - (latest - int(m["yy"])) % 100
    else:
        return None
    month = _MONTHS.index(m["month"]) + 1
    day, hour, minute, second = (int(m[k]) for k in ("day", "hour", "minute", "second"))
    if not (year >= 1 and 1 <= day <= calendar.monthrange(year, month)[1]
            and hour <= 23 and minute <= 59 and second <= 60):  # 60: a leap second
        return None
    return float(calendar.timegm((year, month, day, hour, minute, second)))
