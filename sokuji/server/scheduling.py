"""Scheduling hints a request carries: its priority class and its deadline.

- Priority: header ``X-Sokuji-Priority: interactive | batch``, or the V2 parameter
  ``priority``, either such a name or Triton's integer (0: the default, 1 highest:
  interactive; 2 and above: batch). Default: the tenant's (API key's) priority, else
  interactive. Whatever is asked, the tenant's ``max_priority`` is a ceiling: a tenant held
  to ``batch`` stays batch (silently, as a Triton priority level above the model's range is).
- Timeout: header ``X-Sokuji-Timeout-Ms``, or the V2 parameter ``timeout`` in microseconds
  (Triton's convention), else the model's ``default_timeout_ms``. The deadline is counted from
  the request's arrival. It bounds the request's *start* (``core/policy.py``).

``context`` puts both, with the tenant, into the ``RequestContext`` every layer reads.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Mapping
from typing import Any

from sokuji.core.model import RequestContext
from sokuji.core.request import Priority, Timeline
from sokuji.errors import InvalidInput
from sokuji.observability import tracing
from sokuji.server.auth import Tenant

PRIORITY_HEADER = "x-sokuji-priority"
TIMEOUT_HEADER = "x-sokuji-timeout-ms"
MAX_TIMEOUT_MS = 86_400_000.0
_NAMES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}


def priority(headers: Mapping[str, str], parameters: Mapping[str, Any],
             tenant_default: str | None = None, ceiling: str | None = None) -> Priority:
    """The request's class: what it asks for (else ``tenant_default``), never above
    ``ceiling`` (the tenant's ``max_priority``; None: interactive, no limit)."""
    raw: Any = headers.get(PRIORITY_HEADER, parameters.get("priority"))
    if raw is None or (type(raw) is int and raw == 0):  # Triton's 0: the default level
        asked = _NAMES.get(tenant_default or "", Priority.INTERACTIVE)
    elif isinstance(raw, str) and raw.strip().lower() in _NAMES:
        asked = _NAMES[raw.strip().lower()]
    elif isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
        asked = Priority.INTERACTIVE if raw == 1 else Priority.BATCH
    else:
        raise InvalidInput(f"priority {raw!r} is not one of: interactive, batch (or a Triton "
                           "priority level >= 0)", param="priority")
    if ceiling is None:
        return asked
    return max(asked, _NAMES.get(ceiling, Priority.INTERACTIVE))  # lower value runs first


def deadline_ns(headers: Mapping[str, str], parameters: Mapping[str, Any], arrival_ns: int,
                default_timeout_ms: float) -> int | None:
    header = headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            timeout_ms = float(header)
        except ValueError:
            timeout_ms = -1.0
        if not 0 < timeout_ms < math.inf:
            raise InvalidInput(f"{TIMEOUT_HEADER} {header[:40]!r} must be a finite number of "
                               "milliseconds > 0", param=TIMEOUT_HEADER)
    elif "timeout" in parameters:
        micros = parameters["timeout"]
        if isinstance(micros, bool) or not isinstance(micros, (int, float)) \
                or not 0 < micros < math.inf:
            raise InvalidInput(f"parameter 'timeout' {micros!r} must be a finite number of "
                               "microseconds > 0", param="parameters.timeout")
        timeout_ms = micros / 1e3
    elif default_timeout_ms > 0:
        timeout_ms = default_timeout_ms
    else:
        return None
    # A deadline further away than MAX_TIMEOUT_MS is no deadline in practice; the cap keeps
    # the arithmetic in range for any finite value a client sends.
    return arrival_ns + int(min(timeout_ms, MAX_TIMEOUT_MS) * 1e6)


TRACEPARENT = tracing.TRACEPARENT

company: contextvars.ContextVar[bool] = contextvars.ContextVar("sokuji_company", default=False)
"""Set by a front end in the request's task when others are on their way behind it
(``RequestContext.company``; gRPC: ``grpc_arrivals.py``)."""


def context(tenant: Tenant, headers: Mapping[str, str], parameters: Mapping[str, Any],
            arrival_ns: int, default_timeout_ms: float, request_id: str = "",
            timeline: Timeline | None = None) -> RequestContext:
    """The request's context once its model (its default timeout) and its parameters are
    known: the authenticated tenant, the priority under its ceiling, the deadline; and the
    request's ``Trace`` if it is traced (set by the app in this request's task)."""
    ctx = RequestContext(
        tenant=tenant.name,
        priority=priority(headers, parameters, tenant.priority, tenant.max_priority),
        deadline_ns=deadline_ns(headers, parameters, arrival_ns, default_timeout_ms),
        arrival_ns=arrival_ns, request_id=request_id, traceparent=headers.get(TRACEPARENT),
        timeline=timeline, headers=headers, trace=tracing.current.get(), company=company.get())
    if ctx.trace is not None:
        ctx.trace.ctx = ctx
    return ctx
