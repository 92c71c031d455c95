"""A job as the stores keep it: its states, its quotas, and the contract every job store
(SQLite in ``stores/jobs_sqlite.py``, Redis in ``stores/jobs_redis.py``) fulfils. The life of
a job and what the stores promise are described in ``stores/jobs_sqlite.py``."""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sokuji.errors import StoreUnavailable

log = logging.getLogger("sokuji.stores")
DEFAULT_RESULT_TTL_S = 86400.0
DEFAULT_LEASE_S = 10.0
"""A claim's lease: the runner renews it every third of it; a crash frees the job after it."""
CALLBACK_PENDING = "pending"
Clock = Callable[[], float]


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


FINISHED = (JobStatus.DONE.value, JobStatus.FAILED.value)
UNFINISHED = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)


class QuotaHit(enum.Enum):
    """Why ``submit`` refused a job."""

    PENDING = "pending"
    """The tenant already has ``max_pending`` unfinished jobs."""
    BYTES = "bytes"
    """The tenant's stored bytes plus this body would pass ``max_bytes``."""


@dataclass(frozen=True)
class Usage:
    pending: int
    """Unfinished (queued or running) jobs."""
    stored_bytes: int
    """Request bodies of unfinished jobs plus results of finished, unpurged ones."""


@dataclass(frozen=True)
class Job:
    id: str
    tenant: str
    path: str
    """The request path the job was submitted to (its endpoint)."""
    headers: dict[str, str]
    body: bytes
    """The request body; empty once the job has finished."""
    status: JobStatus
    attempts: int
    """Runs started (claims), crash recoveries and transient retries included."""
    completions: int
    created_at: float
    finished_at: float | None
    result_status: int | None
    result_headers: dict[str, str] | None
    result_body: bytes | None
    callback_url: str | None
    callback_status: str | None
    key_id: str | None = None
    """The ``key_id`` of the API key that submitted it ("": none were configured); None: a
    job stored by a version that did not record it."""
    runner: str | None = None
    """The runner that holds it (running) or completed it."""
    callback_attempts: int = 0
    callback_next_at: float | None = None
    """When the callback is due (an attempt's lease while one runs); None: not due."""


class JobStoreProtocol(Protocol):
    """What the server needs from a store (``JobStore`` and ``RedisJobStore``)."""

    result_ttl_s: float
    lease_s: float
    runner: str

    def submit(self, tenant: str, path: str, headers: dict[str, str], body: bytes,
               callback_url: str | None = None, max_pending: int = 0, *,
               key_id: str | None = None, max_bytes: int = 0) -> str | QuotaHit: ...
    def recover(self) -> int: ...
    def claim(self) -> Job | None: ...
    def renew(self, job_ids: Sequence[str]) -> int: ...
    def release(self, job_ids: Sequence[str]) -> int: ...
    def retry(self, job_id: str, delay_s: float) -> bool: ...
    def complete(self, job_id: str, status: int, headers: dict[str, str],
                 body: bytes) -> bool: ...
    def due_callbacks(self, per_tenant: int) -> list[tuple[str, str]]: ...
    def take_callback(self, job_id: str, lease_s: float) -> Job | None: ...
    def set_callback_status(self, job_id: str, status: str,
                            retry_in_s: float | None = None) -> None: ...
    def get(self, job_id: str) -> Job | None: ...
    def pending(self, tenant: str) -> int: ...
    def usage(self, tenant: str) -> Usage: ...
    def purge(self) -> int: ...
    def close(self) -> None: ...


F = TypeVar("F", bound=Callable[..., Any])


def translated(errors: Callable[[Any], tuple[type[BaseException], ...]], what: str
               ) -> Callable[[F], F]:
    """Decorator: the store's own I/O errors (``errors(self)``) become ``StoreUnavailable``.
    The client's message names no address; the log gets the detail."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except errors(self) as exc:
                log.warning("job store (%s) %s failed: %s: %s", what, method.__name__,
                            type(exc).__name__, exc)
                raise StoreUnavailable(f"the job store is unavailable ({type(exc).__name__}); "
                                       "retry later") from exc

        return call  # type: ignore[return-value]

    return wrap
