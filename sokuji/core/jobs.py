"""Durable asynchronous jobs, in SQLite (WAL) or Redis (``jobs_redis.py``): accepted means
written, done means once, finished means gone after ``result_ttl_s``.

Life of a job: ``queued`` -> ``running`` -> ``done`` | ``failed``, and ``running`` -> ``queued``
again when its answer was transient (``retry``: it waits until ``run_after``). ``submit``
commits before the caller answers 202, so an accepted job survives a crash (WAL with
synchronous=NORMAL is durable against the process dying, SIGKILL included); it refuses (None)
when the tenant already has ``max_pending`` unfinished jobs, counted in the same transaction.
At start-up, jobs left ``running`` by a crash go back to ``queued``. ``complete`` and ``retry``
only move a ``running`` job, in one transaction, so whatever happens around it each job
completes exactly once (``completions`` counts it, for audits and tests). A finished job is
invisible once ``result_ttl_s`` has passed and deleted by ``purge``.

Both stores are synchronous and thread-safe: the server calls them from a small thread pool,
never on the event loop. Their I/O errors become ``StoreUnavailable`` (503) here, at the
adapter boundary.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sokuji.errors import StoreUnavailable

log = logging.getLogger(__name__)
DEFAULT_RESULT_TTL_S = 86400.0


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


FINISHED = (JobStatus.DONE.value, JobStatus.FAILED.value)
UNFINISHED = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)


@dataclass(frozen=True)
class Job:
    id: str
    tenant: str
    path: str
    """The request path the job was submitted to (its endpoint)."""
    headers: dict[str, str]
    body: bytes
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


class JobStoreProtocol(Protocol):
    """What the server needs from a store (``JobStore`` and ``RedisJobStore``)."""

    result_ttl_s: float

    def submit(self, tenant: str, path: str, headers: dict[str, str], body: bytes,
               callback_url: str | None = None, max_pending: int = 0) -> str | None: ...
    def recover(self) -> int: ...
    def claim(self) -> Job | None: ...
    def retry(self, job_id: str, delay_s: float) -> bool: ...
    def complete(self, job_id: str, status: int, headers: dict[str, str],
                 body: bytes) -> bool: ...
    def set_callback_status(self, job_id: str, status: str) -> None: ...
    def get(self, job_id: str) -> Job | None: ...
    def pending(self, tenant: str) -> int: ...
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


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, path TEXT NOT NULL, headers TEXT NOT NULL,
    body BLOB NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    completions INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, finished_at REAL,
    result_status INTEGER, result_headers TEXT, result_body BLOB, callback_url TEXT,
    callback_status TEXT, seq INTEGER NOT NULL, run_after REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (status, seq);
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, status);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished_at);
"""
_COLUMNS = ("id, tenant, path, headers, body, status, attempts, completions, created_at, "
            "finished_at, result_status, result_headers, result_body, callback_url, "
            "callback_status")
PURGE_BATCH = 1000
"""Rows deleted per transaction by ``purge``: submissions never wait behind a long delete."""


def _sqlite_errors(_: Any) -> tuple[type[BaseException], ...]:
    return (sqlite3.OperationalError,)  # locked past busy_timeout, disk full, I/O error


class JobStore:
    """One SQLite connection, serialised by a lock (calls are short: no fsync per commit)."""

    def __init__(self, path: str | Path, result_ttl_s: float = DEFAULT_RESULT_TTL_S) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.result_ttl_s = result_ttl_s
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        if columns and "run_after" not in columns:  # a store written by an older version
            self._db.execute("ALTER TABLE jobs ADD COLUMN run_after REAL NOT NULL DEFAULT 0")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE .. COMMIT under the lock; ROLLBACK if anything raises."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # a failed COMMIT leaves it open too
                    self._db.execute("ROLLBACK")
                raise

    def _tx(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    @translated(_sqlite_errors, "sqlite")
    def submit(self, tenant: str, path: str, headers: dict[str, str], body: bytes,
               callback_url: str | None = None, max_pending: int = 0) -> str | None:
        """The new job's id; None if ``tenant`` already has ``max_pending`` (> 0) unfinished
        jobs."""
        job_id = uuid.uuid4().hex
        with self._transaction() as db:
            if max_pending > 0 and db.execute(
                    "SELECT COUNT(*) FROM jobs WHERE tenant = ? AND status IN (?, ?)",
                    (tenant, *UNFINISHED)).fetchone()[0] >= max_pending:
                return None
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            db.execute(
                "INSERT INTO jobs (id, tenant, path, headers, body, status, created_at, "
                "callback_url, seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, tenant, path, json.dumps(headers), body, JobStatus.QUEUED.value,
                 time.time(), callback_url, seq))
        return job_id

    @translated(_sqlite_errors, "sqlite")
    def recover(self) -> int:
        """After a crash: jobs that were running go back to the queue. Returns how many."""
        return self._tx("UPDATE jobs SET status = ? WHERE status = ?",
                        (JobStatus.QUEUED.value, JobStatus.RUNNING.value)).rowcount

    @translated(_sqlite_errors, "sqlite")
    def claim(self) -> Job | None:
        """The oldest queued job that may run now, now running (its attempts counted), or
        None."""
        with self._transaction() as db:
            row = db.execute("SELECT id FROM jobs WHERE status = ? AND run_after <= ? "
                             "ORDER BY seq LIMIT 1",
                             (JobStatus.QUEUED.value, time.time())).fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET status = ?, attempts = attempts + 1 WHERE id = ?",
                       (JobStatus.RUNNING.value, row[0]))
        return self.get(row[0])

    @translated(_sqlite_errors, "sqlite")
    def retry(self, job_id: str, delay_s: float) -> bool:
        """Put a running job back in the queue, to be claimed no sooner than ``delay_s`` from
        now (it keeps its place in line); False if it was not running."""
        return self._tx("UPDATE jobs SET status = ?, run_after = ? WHERE id = ? AND status = ?",
                        (JobStatus.QUEUED.value, time.time() + delay_s, job_id,
                         JobStatus.RUNNING.value)).rowcount == 1

    @translated(_sqlite_errors, "sqlite")
    def complete(self, job_id: str, status: int, headers: dict[str, str], body: bytes) -> bool:
        """Record the result of a running job; False if it was not running (already ended)."""
        end = JobStatus.DONE if status < 400 else JobStatus.FAILED
        return self._tx(
            "UPDATE jobs SET status = ?, completions = completions + 1, finished_at = ?, "
            "result_status = ?, result_headers = ?, result_body = ? "
            "WHERE id = ? AND status = ?",
            (end.value, time.time(), status, json.dumps(headers), body, job_id,
             JobStatus.RUNNING.value)).rowcount == 1

    @translated(_sqlite_errors, "sqlite")
    def set_callback_status(self, job_id: str, status: str) -> None:
        self._tx("UPDATE jobs SET callback_status = ? WHERE id = ?", (status, job_id))

    @translated(_sqlite_errors, "sqlite")
    def get(self, job_id: str) -> Job | None:
        """The job, or None if there is none or it finished more than ``result_ttl_s`` ago."""
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?",
                                   (job_id,)).fetchone()
        if row is None or (row[9] is not None and row[9] + self.result_ttl_s <= time.time()):
            return None
        return Job(id=row[0], tenant=row[1], path=row[2], headers=json.loads(row[3]),
                   body=row[4], status=JobStatus(row[5]), attempts=row[6], completions=row[7],
                   created_at=row[8], finished_at=row[9], result_status=row[10],
                   result_headers=json.loads(row[11]) if row[11] else None,
                   result_body=row[12], callback_url=row[13], callback_status=row[14])

    @translated(_sqlite_errors, "sqlite")
    def pending(self, tenant: str) -> int:
        """The tenant's unfinished (queued or running) jobs."""
        return int(self._tx("SELECT COUNT(*) FROM jobs WHERE tenant = ? AND status IN (?, ?)",
                            (tenant, *UNFINISHED)).fetchone()[0])

    @translated(_sqlite_errors, "sqlite")
    def purge(self) -> int:
        """Delete jobs that finished more than ``result_ttl_s`` ago; how many."""
        cutoff, total = time.time() - self.result_ttl_s, 0
        while True:
            deleted = self._tx(
                "DELETE FROM jobs WHERE id IN (SELECT id FROM jobs WHERE finished_at <= ? "
                "AND status IN (?, ?) LIMIT ?)", (cutoff, *FINISHED, PURGE_BATCH)).rowcount
            total += deleted
            if deleted < PURGE_BATCH:
                return total

    def count(self, status: JobStatus) -> int:
        return int(self._tx("SELECT COUNT(*) FROM jobs WHERE status = ?",
                            (status.value,)).fetchone()[0])
