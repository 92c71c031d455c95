"""The one error mapper: any exception raised while serving a request -> the ``SokujiError``
to answer with (logged when it is a bug) -> a reply in the error format of the protocol the
route speaks, chosen by the route (its codec), never guessed from the path.

- ``V2`` (KServe V2 / Triton): ``{"error": message, "code": code}``;
- ``OPENAI``: ``{"error": {"message", "type", "param", "code"}}``.

The error's own headers go with it (``Retry-After`` on a 429, ``Allow`` on a 405,
``WWW-Authenticate`` on a 401). A 5xx is logged unless it is load shedding (deadline, not
ready); anything outside the error tree is a bug: logged with its traceback, answered 500.
"""

from __future__ import annotations

import enum
import logging

import orjson

from sokuji.errors import DeadlineExceeded, ModelNotReady, SokujiError, StepFailed
from sokuji.server import openai_api
from sokuji.server.http import JSON, Reply

log = logging.getLogger(__name__)


class ErrorStyle(enum.Enum):
    V2 = "v2"
    OPENAI = "openai"


def to_error(exc: BaseException, method: str, path: str) -> SokujiError:
    """``exc`` as the error tree says it (logging 5xx that are not load shedding, and
    anything outside the tree as a 500 with its traceback)."""
    if isinstance(exc, SokujiError):
        if exc.status >= 500 and not isinstance(exc, (DeadlineExceeded, ModelNotReady)) \
                and not (isinstance(exc, StepFailed) and exc.status in (503, 504)):
            log.error("%s %s: %s", method, path, exc.message)
        return exc
    log.error("unhandled error on %s %s", method, path, exc_info=exc)
    return SokujiError(f"internal error: {type(exc).__name__}")


def error_body(style: ErrorStyle, status: int, code: str, message: str,
               param: str | None = None) -> bytes:
    if style is ErrorStyle.OPENAI:
        return openai_api.error_body(status, code, message, param)
    return orjson.dumps({"error": message, "code": code})


def error_reply(exc: SokujiError, style: ErrorStyle) -> Reply:
    return Reply(exc.status, error_body(style, exc.status, exc.code, exc.message, exc.param),
                 {"content-type": JSON, **exc.headers})
