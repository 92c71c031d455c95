"""Scheduling hints a request carries: its priority class and its deadline.

- Priority: header ``X-Sokuji-Priority: interactive | batch``, or the V2 parameter
  ``priority``, either such a name or Triton's integer (0 default, 1 highest: interactive;
  2 and above: batch). Default: the tenant's (API key's) priority, else interactive.
- Timeout: header ``X-Sokuji-Timeout-Ms``, or the V2 parameter ``timeout`` in microseconds
  (Triton's convention), else the model's ``default_timeout_ms``. The deadline is counted from
  the request's arrival.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sokuji.core.request import Priority
from sokuji.errors import InvalidInput

PRIORITY_HEADER = "x-sokuji-priority"
TIMEOUT_HEADER = "x-sokuji-timeout-ms"
_NAMES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}


def priority(headers: Mapping[str, str], parameters: Mapping[str, Any],
             tenant_default: str | None = None) -> Priority:
    raw: Any = headers.get(PRIORITY_HEADER, parameters.get("priority"))
    if raw is None:
        return _NAMES.get(tenant_default or "", Priority.INTERACTIVE)
    if isinstance(raw, str) and raw.strip().lower() in _NAMES:
        return _NAMES[raw.strip().lower()]
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        return Priority.INTERACTIVE if raw <= 1 else Priority.BATCH
    raise InvalidInput(f"priority {raw!r} is not one of: interactive, batch (or a Triton "
                       "priority level >= 0)", param="priority")


def deadline_ns(headers: Mapping[str, str], parameters: Mapping[str, Any], arrival_ns: int,
                default_timeout_ms: float) -> int | None:
    header = headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            timeout_ms = float(header)
        except ValueError:
            timeout_ms = -1.0
        if not timeout_ms > 0:
            raise InvalidInput(f"{TIMEOUT_HEADER} {header!r} must be a number of milliseconds "
                               "> 0", param=TIMEOUT_HEADER)
    elif "timeout" in parameters:
        micros = parameters["timeout"]
        if isinstance(micros, bool) or not isinstance(micros, (int, float)) or micros <= 0:
            raise InvalidInput(f"parameter 'timeout' {micros!r} must be a number of "
                               "microseconds > 0", param="parameters.timeout")
        timeout_ms = micros / 1e3
    elif default_timeout_ms > 0:
        timeout_ms = default_timeout_ms
    else:
        return None
    return arrival_ns + int(timeout_ms * 1e6)
