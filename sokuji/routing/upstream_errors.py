"""An upstream's failures as Sokuji's typed errors (``upstream_http.py`` raises them;
routers read ``before_response`` and ``target_fault`` to decide a fallback).

Each says ``before_response`` (no response byte came, so another target may safely answer),
``target_fault`` (the target, not the client or the deadline, failed) and ``retry_after_s``
where the upstream said. 400/404/413/415/422 stay the client's fault
with the same status (the upstream's message, prefixed and cut short); 401/403 are 502 (our
credential is wrong: the body is not shown); 429 is 429 with the upstream's
``Retry-After``; 503 stays 503 with it; 504 (a Sokuji upstream could not start in time)
stays 504; any other status 502; refused or reset connections 503; our own timeout 504.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from sokuji.core.retry_after import parse_retry_after
from sokuji.errors import DeadlineExceeded, Overloaded, SokujiError

ERROR_BODY_CHARS = 500
"""Of an upstream's error message, at most this much reaches our client."""
_CLIENT_FAULT = {400: "invalid_input", 404: "not_found", 413: "payload_too_large",
                 415: "unsupported_media_type", 422: "invalid_input"}


class UpstreamInfo:
    """What an upstream's error says beside its status (read by the router)."""

    before_response: bool = False
    """No response byte came back: nothing was answered, another target may answer."""
    target_fault: bool = True
    """The upstream failed (its breaker counts it); False: the client's fault, or our own
    deadline."""
    upstream_status: int | None = None


class UpstreamFailed(UpstreamInfo, SokujiError):
    """502: the upstream gave no valid answer (5xx, a bad body, a redirect, a broken stream,
    a rejected credential)."""

    status = 502
    code = "upstream_failed"

    def __init__(self, message: str, *, upstream_status: int | None = None,
                 before_response: bool = False) -> None:
        super().__init__(message)
        self.upstream_status = upstream_status
        self.before_response = before_response
        self.retry_after_s: int | None = None


class UpstreamUnavailable(UpstreamInfo, SokujiError):
    """503: the upstream cannot be reached (connection refused or reset), or said 503."""

    status = 503
    code = "upstream_unavailable"

    def __init__(self, message: str, *, retry_after_s: int | None = None,
                 before_response: bool = False, upstream_status: int | None = None) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after_s)}
                         if retry_after_s is not None else None)
        self.retry_after_s = retry_after_s
        self.before_response = before_response
        self.upstream_status = upstream_status


class UpstreamRejected(UpstreamInfo, SokujiError):
    """The upstream refused the request as the client's fault: the same 4xx."""

    target_fault = False

    def __init__(self, message: str, *, status: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.status = status
        self.code = _CLIENT_FAULT.get(status, "bad_request")
        self.upstream_status = status
        self.retry_after_s: int | None = None


class UpstreamOverloaded(UpstreamInfo, Overloaded):
    """429 from the upstream, with its ``Retry-After`` (1 s when it gave none)."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.upstream_status = 429


class UpstreamTimeout(UpstreamInfo, DeadlineExceeded):
    """504: no answer within the attempt's budget; or the deadline had passed before the
    call (``target_fault`` False); or a Sokuji upstream could not start it in time."""

    def __init__(self, message: str, *, before_response: bool, target_fault: bool = True,
                 upstream_status: int | None = None) -> None:
        super().__init__(message)
        self.before_response = before_response
        self.target_fault = target_fault
        self.upstream_status = upstream_status
        self.retry_after_s: int | None = None


def error_message(body: bytes) -> tuple[str, str | None]:
    """An error body's message (OpenAI ``error.message``, V2 ``error``, else the text) and
    its ``param``, cut to ``ERROR_BODY_CHARS``."""
    param = None
    try:
        doc: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    text = body.decode("utf-8", "replace")
    if isinstance(doc, dict):
        err = doc.get("error", doc.get("message"))
        if isinstance(err, dict):
            param = err.get("param") if isinstance(err.get("param"), str) else None
            err = err.get("message")
        if isinstance(err, str):
            text = err
    text = " ".join(text.split())
    if len(text) > ERROR_BODY_CHARS:
        text = text[:ERROR_BODY_CHARS] + "..."
    return text, param


def status_error(who: str, status: int, body: bytes, headers: Mapping[str, str]
                 ) -> SokujiError:
    """The error for an upstream's non-2xx answer. ``who`` names it (our model, theirs)."""
    retry = parse_retry_after(headers.get("retry-after"))
    if status in _CLIENT_FAULT:
        text, param = error_message(body)
        return UpstreamRejected(f"{who}: {text}", status=status, param=param)
    if status in (401, 403):
        return UpstreamFailed(f"{who}: the upstream refused our credential ({status}); "
                              "check the model's api_key_env / tenant_keys_env",
                              upstream_status=status)
    if status == 429:
        text, _ = error_message(body)
        return UpstreamOverloaded(f"{who}: overloaded: {text}",
                                  retry_after_s=retry if retry is not None else 1)
    if status == 503:
        text, _ = error_message(body)
        return UpstreamUnavailable(f"{who}: unavailable (503): {text}", retry_after_s=retry,
                                   upstream_status=503)
    if status == 504:
        text, _ = error_message(body)
        return UpstreamTimeout(f"{who}: {text}", before_response=False, target_fault=False,
                               upstream_status=504)
    if 300 <= status < 400:
        return UpstreamFailed(f"{who}: answered a redirect ({status}), which is not followed",
                              upstream_status=status)
    text, _ = error_message(body)
    return UpstreamFailed(f"{who}: failed ({status}): {text}", upstream_status=status)
