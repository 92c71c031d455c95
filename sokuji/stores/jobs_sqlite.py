"""Durable asynchronous jobs, in SQLite (WAL) or Redis (``jobs_redis.py``): accepted means
written, done means once, finished means gone after ``result_ttl_s``.

Life of a job: ``queued`` -> ``running`` -> ``done`` | ``failed``, and ``running`` -> ``queued``
again when its answer was transient (``retry``: it waits until ``run_after``). ``submit``
commits before the caller answers 202, so an accepted job survives a crash (WAL with
synchronous=NORMAL is durable against the process dying, SIGKILL included). It refuses
(``QuotaHit``) when the tenant already has ``max_pending`` unfinished jobs, or when the bytes
it keeps stored would pass ``max_bytes``, both counted in the same transaction.

- **Leases**: each store object is one runner (``runner``, a random id). ``claim`` stamps the
  job with its runner and a lease of ``lease_s``; the runner ``renew``s the lease while it
  works. ``recover`` puts back in the queue the running jobs whose lease has passed (their
  runner crashed, or lost the store for longer than a lease) and never a live peer's.
  ``retry`` and ``complete`` only move a job the caller's runner holds, in one transaction,
  so each job completes exactly once (``completions`` counts it). ``complete`` is idempotent
  for its runner: asked again (a reply lost on the way back) it answers True again.
- **Bytes**: a job counts its request body against its tenant while unfinished; on completion
  the body is deleted and the result counts instead, until the job is purged (Redis: until
  it expires). ``usage`` gives a tenant's unfinished jobs and stored bytes.
- **Callbacks**: completing a job that has a callback URL makes its callback due at once
  (``callback_status`` ``pending``). ``due_callbacks`` lists due ones, at most ``per_tenant``
  of each tenant; ``take_callback`` leases one for an attempt (it is due again when the lease
  passes: a crash mid-delivery delivers again, at least once) and returns the job, result
  included; ``set_callback_status`` records an outcome, or the wait before the next attempt.

A finished job is invisible once ``result_ttl_s`` has passed and deleted by ``purge``. Both
stores are synchronous and thread-safe: the server calls them from a small thread pool, never
on the event loop. Their I/O errors become ``StoreUnavailable`` (503) here, at the adapter
boundary. ``clock`` (default ``time.time``) is every timestamp's source, for tests.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sokuji.core.job import (
    CALLBACK_PENDING,
    DEFAULT_LEASE_S,
    DEFAULT_RESULT_TTL_S,
    FINISHED,
    UNFINISHED,
    Clock,
    Job,
    JobStatus,
    QuotaHit,
    Usage,
    translated,
)

log = logging.getLogger(__name__)


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, path TEXT NOT NULL, headers TEXT NOT NULL,
    body BLOB NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    completions INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, finished_at REAL,
    result_status INTEGER, result_headers TEXT, result_body BLOB, callback_url TEXT,
    callback_status TEXT, seq INTEGER NOT NULL, run_after REAL NOT NULL DEFAULT 0,
    key_id TEXT, runner TEXT, lease_until REAL, stored INTEGER NOT NULL DEFAULT 0,
    callback_attempts INTEGER NOT NULL DEFAULT 0, callback_next_at REAL
);
CREATE TABLE IF NOT EXISTS tenant_bytes (tenant TEXT PRIMARY KEY, bytes INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (status, seq);
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, status);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished_at);
CREATE INDEX IF NOT EXISTS jobs_callbacks ON jobs (callback_next_at)
    WHERE callback_next_at IS NOT NULL;
"""
ADDED_COLUMNS = {"run_after": "REAL NOT NULL DEFAULT 0", "key_id": "TEXT", "runner": "TEXT",
                 "lease_until": "REAL", "stored": "INTEGER NOT NULL DEFAULT 0",
                 "callback_attempts": "INTEGER NOT NULL DEFAULT 0",
                 "callback_next_at": "REAL"}
"""Columns a store written by an older version lacks; added in place at start-up."""
_COLUMNS = ("id, tenant, path, headers, body, status, attempts, completions, created_at, "
            "finished_at, result_status, result_headers, result_body, callback_url, "
            "callback_status, key_id, runner, callback_attempts, callback_next_at")
PURGE_BATCH = 1000
"""Rows deleted per transaction by ``purge``: submissions never wait behind a long delete."""
_IDS_PER_STATEMENT = 500


def _sqlite_errors(_: Any) -> tuple[type[BaseException], ...]:
    return (sqlite3.OperationalError,)  # locked past busy_timeout, disk full, I/O error


def _chunks(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(ids), _IDS_PER_STATEMENT):
        yield ids[i:i + _IDS_PER_STATEMENT]


class JobStore:
    """One SQLite connection, serialised by a lock (calls are short: no fsync per commit)."""

    def __init__(self, path: str | Path, result_ttl_s: float = DEFAULT_RESULT_TTL_S,
                 lease_s: float = DEFAULT_LEASE_S, clock: Clock = time.time) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.result_ttl_s = result_ttl_s
        self.lease_s = lease_s
        self.runner = uuid.uuid4().hex
        self._clock = clock
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for name, kind in ADDED_COLUMNS.items():
            if columns and name not in columns:  # a store written by an older version
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
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
               callback_url: str | None = None, max_pending: int = 0, *,
               key_id: str | None = None, max_bytes: int = 0) -> str | QuotaHit:
        """The new job's id, or why it was refused: ``tenant`` already has ``max_pending``
        (> 0) unfinished jobs, or its stored bytes plus ``body`` would pass ``max_bytes``
        (> 0)."""
        job_id = uuid.uuid4().hex
        with self._transaction() as db:
            if max_pending > 0 and db.execute(
                    "SELECT COUNT(*) FROM jobs WHERE tenant = ? AND status IN (?, ?)",
                    (tenant, *UNFINISHED)).fetchone()[0] >= max_pending:
                return QuotaHit.PENDING
            if max_bytes > 0 and self._bytes(db, tenant) + len(body) > max_bytes:
                return QuotaHit.BYTES
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            db.execute(
                "INSERT INTO jobs (id, tenant, path, headers, body, status, created_at, "
                "callback_url, seq, key_id, stored) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, tenant, path, json.dumps(headers), body, JobStatus.QUEUED.value,
                 self._clock(), callback_url, seq, key_id, len(body)))
            self._add_bytes(db, tenant, len(body))
        return job_id

    @staticmethod
    def _bytes(db: sqlite3.Connection, tenant: str) -> int:
        row = db.execute("SELECT bytes FROM tenant_bytes WHERE tenant = ?", (tenant,)).fetchone()
        return int(row[0]) if row else 0

    @staticmethod
    def _add_bytes(db: sqlite3.Connection, tenant: str, delta: int) -> None:
        db.execute("INSERT INTO tenant_bytes (tenant, bytes) VALUES (?, MAX(0, ?)) "
                   "ON CONFLICT (tenant) DO UPDATE SET bytes = MAX(0, bytes + ?)",
                   (tenant, delta, delta))

    @translated(_sqlite_errors, "sqlite")
    def recover(self) -> int:
        """Running jobs whose lease has passed go back to the queue (at their old place in
        line); a live runner's are left alone. Returns how many."""
        return self._tx("UPDATE jobs SET status = ?, runner = NULL, lease_until = NULL "
                        "WHERE status = ? AND (lease_until IS NULL OR lease_until <= ?)",
                        (JobStatus.QUEUED.value, JobStatus.RUNNING.value,
                         self._clock())).rowcount

    @translated(_sqlite_errors, "sqlite")
    def claim(self) -> Job | None:
        """The oldest queued job that may run now, now running under this runner's lease (its
        attempts counted), or None."""
        now = self._clock()
        with self._transaction() as db:
            row = db.execute("SELECT id FROM jobs WHERE status = ? AND run_after <= ? "
                             "ORDER BY seq LIMIT 1", (JobStatus.QUEUED.value, now)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET status = ?, attempts = attempts + 1, runner = ?, "
                       "lease_until = ? WHERE id = ?",
                       (JobStatus.RUNNING.value, self.runner, now + self.lease_s, row[0]))
        return self.get(row[0])

    @translated(_sqlite_errors, "sqlite")
    def renew(self, job_ids: Sequence[str]) -> int:
        """Extend this runner's lease on those of ``job_ids`` it still holds; how many."""
        until, renewed = self._clock() + self.lease_s, 0
        for chunk in _chunks(job_ids):
            marks = ", ".join("?" * len(chunk))
            renewed += self._tx(f"UPDATE jobs SET lease_until = ? WHERE status = ? AND "
                                f"runner = ? AND id IN ({marks})",
                                (until, JobStatus.RUNNING.value, self.runner, *chunk)).rowcount
        return renewed

    @translated(_sqlite_errors, "sqlite")
    def release(self, job_ids: Sequence[str]) -> int:
        """Put those of ``job_ids`` this runner holds back in the queue at once (a graceful
        stop: nobody need wait for the lease); how many."""
        released = 0
        for chunk in _chunks(job_ids):
            marks = ", ".join("?" * len(chunk))
            released += self._tx(f"UPDATE jobs SET status = ?, runner = NULL, lease_until = "
                                 f"NULL WHERE status = ? AND runner = ? AND id IN ({marks})",
                                 (JobStatus.QUEUED.value, JobStatus.RUNNING.value,
                                  self.runner, *chunk)).rowcount
        return released

    @translated(_sqlite_errors, "sqlite")
    def retry(self, job_id: str, delay_s: float) -> bool:
        """Put a job this runner holds back in the queue, to be claimed no sooner than
        ``delay_s`` from now (it keeps its place in line); False if it does not hold it."""
        return self._tx("UPDATE jobs SET status = ?, run_after = ?, runner = NULL, "
                        "lease_until = NULL WHERE id = ? AND status = ? AND runner = ?",
                        (JobStatus.QUEUED.value, self._clock() + delay_s, job_id,
                         JobStatus.RUNNING.value, self.runner)).rowcount == 1

    @translated(_sqlite_errors, "sqlite")
    def complete(self, job_id: str, status: int, headers: dict[str, str], body: bytes) -> bool:
        """Record the result of a job this runner holds, delete its request body and make its
        callback due. True if it completed now or had already been completed by this runner;
        False if another runner holds or completed it (this result is dropped)."""
        end = JobStatus.DONE if status < 400 else JobStatus.FAILED
        with self._transaction() as db:
            row = db.execute("SELECT status, runner, tenant, stored FROM jobs WHERE id = ?",
                             (job_id,)).fetchone()
            if row is None or row[1] != self.runner:
                return False
            if row[0] != JobStatus.RUNNING.value:
                return row[0] in FINISHED  # completed by this runner: a repeated call
            now = self._clock()
            db.execute(
                "UPDATE jobs SET status = ?, completions = completions + 1, finished_at = ?, "
                "result_status = ?, result_headers = ?, result_body = ?, body = x'', "
                "lease_until = NULL, stored = ?, "
                "callback_status = CASE WHEN callback_url IS NULL THEN NULL ELSE ? END, "
                "callback_next_at = CASE WHEN callback_url IS NULL THEN NULL ELSE ? END "
                "WHERE id = ?",
                (end.value, now, status, json.dumps(headers), body, len(body),
                 CALLBACK_PENDING, now, job_id))
            self._add_bytes(db, row[2], len(body) - row[3])
        return True

    @translated(_sqlite_errors, "sqlite")
    def due_callbacks(self, per_tenant: int) -> list[tuple[str, str]]:
        """``(job id, tenant)`` of callbacks due now, oldest first, at most ``per_tenant`` of
        each tenant (one tenant's backlog never hides another's)."""
        now = self._clock()
        rows = self._tx(
            "SELECT id, tenant FROM (SELECT id, tenant, callback_next_at, ROW_NUMBER() OVER "
            "(PARTITION BY tenant ORDER BY callback_next_at) AS n FROM jobs "
            "WHERE callback_next_at <= ? AND finished_at > ?) WHERE n <= ? "
            "ORDER BY callback_next_at", (now, now - self.result_ttl_s, per_tenant)).fetchall()
        return [(str(r[0]), str(r[1])) for r in rows]

    @translated(_sqlite_errors, "sqlite")
    def take_callback(self, job_id: str, lease_s: float) -> Job | None:
        """Lease a due callback for one attempt (counted): the job, result included, or None
        if it is not due (another runner took it, or it ended)."""
        now = self._clock()
        taken = self._tx("UPDATE jobs SET callback_next_at = ?, callback_attempts = "
                         "callback_attempts + 1 WHERE id = ? AND callback_next_at <= ?",
                         (now + lease_s, job_id, now)).rowcount
        return self.get(job_id) if taken else None

    @translated(_sqlite_errors, "sqlite")
    def set_callback_status(self, job_id: str, status: str,
                            retry_in_s: float | None = None) -> None:
        """Record the callback's outcome; with ``retry_in_s``, it is due again then."""
        next_at = None if retry_in_s is None else self._clock() + retry_in_s
        self._tx("UPDATE jobs SET callback_status = ?, callback_next_at = ? WHERE id = ?",
                 (status, next_at, job_id))

    @translated(_sqlite_errors, "sqlite")
    def get(self, job_id: str) -> Job | None:
        """The job, or None if there is none or it finished more than ``result_ttl_s`` ago."""
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?",
                                   (job_id,)).fetchone()
        if row is None or (row[9] is not None and row[9] + self.result_ttl_s <= self._clock()):
            return None
        return Job(id=row[0], tenant=row[1], path=row[2], headers=json.loads(row[3]),
                   body=row[4], status=JobStatus(row[5]), attempts=row[6], completions=row[7],
                   created_at=row[8], finished_at=row[9], result_status=row[10],
                   result_headers=json.loads(row[11]) if row[11] else None,
                   result_body=row[12], callback_url=row[13], callback_status=row[14],
                   key_id=row[15], runner=row[16], callback_attempts=row[17],
                   callback_next_at=row[18])

    @translated(_sqlite_errors, "sqlite")
    def pending(self, tenant: str) -> int:
        """The tenant's unfinished (queued or running) jobs."""
        return int(self._tx("SELECT COUNT(*) FROM jobs WHERE tenant = ? AND status IN (?, ?)",
                            (tenant, *UNFINISHED)).fetchone()[0])

    @translated(_sqlite_errors, "sqlite")
    def usage(self, tenant: str) -> Usage:
        with self._lock:
            return Usage(int(self._db.execute(
                "SELECT COUNT(*) FROM jobs WHERE tenant = ? AND status IN (?, ?)",
                (tenant, *UNFINISHED)).fetchone()[0]), self._bytes(self._db, tenant))

    @translated(_sqlite_errors, "sqlite")
    def purge(self) -> int:
        """Delete jobs that finished more than ``result_ttl_s`` ago (their bytes no longer
        count); how many."""
        cutoff, total = self._clock() - self.result_ttl_s, 0
        batch = ("SELECT id FROM jobs WHERE finished_at <= ? AND status IN (?, ?) "
                 "ORDER BY id LIMIT ?")
        args = (cutoff, *FINISHED, PURGE_BATCH)
        while True:
            with self._transaction() as db:
                for tenant, freed in db.execute(f"SELECT tenant, SUM(stored) FROM jobs WHERE "
                                                f"id IN ({batch}) GROUP BY tenant", args):
                    self._add_bytes(db, tenant, -int(freed))
                deleted = db.execute(f"DELETE FROM jobs WHERE id IN ({batch})", args).rowcount
            total += deleted
            if deleted < PURGE_BATCH:
                return total

    def count(self, status: JobStatus) -> int:
        return int(self._tx("SELECT COUNT(*) FROM jobs WHERE status = ?",
                            (status.value,)).fetchone()[0])
