"""One error tree for Sokuji; each error carries the HTTP status it maps to.

    SokujiError (500)
    ├── ConfigError (start-up only: names the key and the value)
    ├── BadRequest (400)
    │   ├── InvalidInput (400)     a field or tensor is wrong; the message names it
    │   ├── TooManyItems (400)     more items than the model's max_batch_size
    │   ├── LoadFailed (400)       a model (re)load failed: the version serving still serves
    │   ├── PayloadTooLarge (413)
    │   ├── UnsupportedMediaType (415)
    │   └── InputFailed (422)      the model ran the request alone and failed on its input
    ├── Unauthorized (401)         missing or unknown API key
    ├── Forbidden (403)            the tenant may not use this model
    ├── NotFound (404)
    │   └── ModelNotFound (404)
    ├── MethodNotAllowed (405)
    ├── RequestTimeout (408)       a body or a stream did not arrive in time (closes the connection)
    ├── ModelNotReady (503)
    ├── StoreUnavailable (503)     the job store (Redis, SQLite) cannot be reached: retry later
    ├── RouteUnavailable (503)     every target a router may use is failing: with Retry-After
    ├── Overloaded (429)           queue or concurrency limit: rejected at once, with Retry-After
    ├── DeadlineExceeded (504)     could not start before its deadline: never computed
    ├── StepFailed (502, or the step's 4xx / 429 / 503 / 504)  a pipeline step failed
    ├── ModelCodeFailed (502)      a Python model's own code raised (its type named)
    ├── BadModelOutput (502)       a Python model returned what it may not (wrong count, type)
    ├── WorkerLost (503)           a Python model's worker process crashed or hung: replaced
    └── RuntimeFailed (500)        the runtime raised while running a batch

Third-party exceptions are translated at the adapter boundary (``raise RuntimeFailed(...) from
exc``); one handler in the server maps this tree to responses and one catch-all answers 500.
"""

from __future__ import annotations

import re

_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]*@")


class SokujiError(Exception):
    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled whole (keyword-only arguments and all): an error raised in another process
        (a Ray Serve replica, a worker) arrives as itself, with its status and headers."""
        return _restore, (type(self), self.args, self.__dict__)


def _restore(cls: type[SokujiError], args: tuple[object, ...],
             state: dict[str, object]) -> SokujiError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(SokujiError):
    code = "config_error"

    @classmethod
    def for_key(cls, key: str, value: object, reason: str) -> ConfigError:
        """Names the key and the value, except what may be a secret: the value of a key named
        like one (``key``, ``*secret*``, ``*password*``, ``*token*``) is ``'***'``, and a
        URL's password is masked wherever it appears (a typo in a key name included)."""
        leaf = key.rsplit(".", 1)[-1].lower()
        if leaf == "key" or any(w in leaf for w in ("secret", "password", "token")):
            shown = "'***'"
        else:
            shown = _URL_PASSWORD.sub(r"\1***@", repr(value))
        return cls(f"Config '{key}' has value {shown}: {reason}", param=key)


class BadRequest(SokujiError):
    status = 400
    code = "bad_request"


class InvalidInput(BadRequest):
    code = "invalid_input"


class TooManyItems(BadRequest):
    code = "too_many_items"


class LoadFailed(BadRequest):
    """A load that failed (Triton answers 400): the version serving, if any, still serves
    (``repository/control.py``; a bad config override, ``repository/sources.py``)."""

    code = "load_failed"


class PayloadTooLarge(BadRequest):
    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(BadRequest):
    status = 415
    code = "unsupported_media_type"


class InputFailed(BadRequest):
    """A tensor model's graph failed on this request's input, run alone, after it had
    computed others (its warm-up or earlier requests): every declared check passed, but
    the graph cannot compute these values (an index past a table, a reshape that does not
    divide). The message is ONNX Runtime's, naming the node."""

    status = 422
    code = "input_failed"


class NotFound(SokujiError):
    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(SokujiError):
    """405, with the ``Allow`` header RFC 9110 requires (the methods the resource takes)."""

    status = 405
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: tuple[str, ...] = ("POST",)) -> None:
        super().__init__(message, headers={"allow": ", ".join(allow)})
        self.allow = allow


class RequestTimeout(SokujiError):
    """408: the request's body (or a stream's) did not arrive in time; the message names
    the bound. ``Connection: close`` goes with it: what is left of the body is never read."""

    status = 408
    code = "request_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"connection": "close"})


class ModelNotReady(SokujiError):
    status = 503
    code = "model_not_ready"


class StoreUnavailable(SokujiError):
    """503 with Retry-After: a store the request needs is down or too slow. The message is
    for clients: it never names the store's address (details go to the log)."""

    status = 503
    code = "store_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after_s)})


class RouteUnavailable(SokujiError):
    """503 with Retry-After: every target the router could use is cooling down after
    failures (circuit breakers open), or failed this request."""

    status = 503
    code = "route_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class GrammarFailed(SokujiError):
    """A constrained generation whose grammar allows no next token (llguidance's limits ran
    out at a step, or the grammar describes no text from here): it ends here, with the
    reason, rather than go on unconstrained. 422: the request could not be answered as it
    asked (most such grammars are refused at compile time with a 400 instead)."""

    status = 422
    code = "grammar_failed"

    def __init__(self, model: str, why: str | None) -> None:
        super().__init__(f"model '{model}': the output's grammar cannot go on: "
                         f"{why or 'no token is allowed'}")


class ModelCodeFailed(SokujiError):
    """502: a Python model's own code (``setup`` aside: that stops start-up) raised while it
    ran a batch. Only that batch's requests fail; the message names the model and the
    exception's type, never its text or traceback (they go to the log): a batch mixes
    tenants, and an exception's text may carry another request's data. A 502, not a 500: the
    server is a gateway to the model's code, which gave no valid answer; a 500 stays a
    Sokuji bug."""

    status = 502
    code = "model_error"


class BadModelOutput(SokujiError):
    """502: a Python model returned what its contract does not allow (a number of results
    other than the batch's, a value that is not an array or a JSON value, an output its
    metadata does not name); the message names the model and what was wrong."""

    status = 502
    code = "bad_model_output"


class WorkerLost(SokujiError):
    """503 with Retry-After: the worker process running this request's batch exited (a
    crash, ``os._exit``, a signal) or ran past the model's ``timeout_ms`` and was killed; a
    new one is being started, so a retry is served."""

    status = 503
    code = "worker_lost"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class RuntimeFailed(SokujiError):
    status = 500
    code = "runtime_failed"


class Overloaded(SokujiError):
    status = 429
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class DeadlineExceeded(SokujiError):
    status = 504
    code = "deadline_exceeded"


class Unauthorized(SokujiError):
    status = 401
    code = "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"www-authenticate": "Bearer"})


class Forbidden(SokujiError):
    status = 403
    code = "forbidden"


class StepFailed(SokujiError):
    """A pipeline step failed: the step's own error (4xx, 429, 503, 504: status, code and
    headers such as Retry-After kept), its message naming the pipeline and the step. What
    would be a 500 of its own (a runtime failure; a user function that raised something
    other than a ``SokujiError``) is a 502: the pipeline, like a gateway, got no valid
    answer from a part."""

    status = 502
    code = "step_failed"

    def __init__(self, pipeline: str, step: str, cause: BaseException) -> None:
        if isinstance(cause, SokujiError):
            what, param, headers = cause.message, cause.param, cause.headers
            if cause.status < 500 or cause.status in (503, 504):
                self.status, self.code = cause.status, cause.code
        else:
            what, param, headers = f"{type(cause).__name__}: {str(cause)[:200]}", None, None
        super().__init__(f"pipeline '{pipeline}', step '{step}': {what}", param=param,
                         headers=headers)
        self.step = step
