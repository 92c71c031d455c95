"""Durable asynchronous jobs, in SQLite (WAL) or Redis: accepted means written, and done means
once.

Life of a job: ``queued`` -> ``running`` -> ``done`` | ``failed``. ``submit`` commits before
the caller answers 202, so an accepted job survives a crash (WAL with synchronous=NORMAL is
durable against the process dying, SIGKILL included). At start-up, jobs left ``running`` by a
crash go back to ``queued``. ``complete`` only moves a ``running`` job to its end state, in one
transaction, so whatever happens around it each job completes exactly once (``completions``
counts it, for audits and tests).
"""

from __future__ import annotations

import enum
import json
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


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
    completions: int
    created_at: float
    finished_at: float | None
    result_status: int | None
    result_headers: dict[str, str] | None
    result_body: bytes | None
    callback_url: str | None
    callback_status: str | None


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, path TEXT NOT NULL, headers TEXT NOT NULL,
    body BLOB NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    completions INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, finished_at REAL,
    result_status INTEGER, result_headers TEXT, result_body BLOB, callback_url TEXT,
    callback_status TEXT, seq INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (status, seq);
"""


class JobStore:
    """One SQLite connection, serialised by a lock (calls are short: no fsync per commit)."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def submit(self, tenant: str, path: str, headers: dict[str, str], body: bytes,
               callback_url: str | None = None) -> str:
        job_id = uuid.uuid4().hex
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            self._db.execute(
                "INSERT INTO jobs (id, tenant, path, headers, body, status, created_at, "
                "callback_url, seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, tenant, path, json.dumps(headers), body, JobStatus.QUEUED.value,
                 time.time(), callback_url, seq))
        return job_id

    def recover(self) -> int:
        """After a crash: jobs that were running go back to the queue. Returns how many."""
        return self._tx("UPDATE jobs SET status = ? WHERE status = ?",
                        (JobStatus.QUEUED.value, JobStatus.RUNNING.value)).rowcount

    def claim(self) -> Job | None:
        """The oldest queued job, now running (its attempts counted), or None."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT id FROM jobs WHERE status = ? ORDER BY seq LIMIT 1",
                                   (JobStatus.QUEUED.value,)).fetchone()
            if row is None:
                self._db.execute("COMMIT")
                return None
            self._db.execute("UPDATE jobs SET status = ?, attempts = attempts + 1 WHERE id = ?",
                             (JobStatus.RUNNING.value, row[0]))
            self._db.execute("COMMIT")
        return self.get(row[0])

    def complete(self, job_id: str, status: int, headers: dict[str, str], body: bytes) -> bool:
        """Record the result of a running job; False if it was not running (already ended)."""
        end = JobStatus.DONE if status < 400 else JobStatus.FAILED
        return self._tx(
            "UPDATE jobs SET status = ?, completions = completions + 1, finished_at = ?, "
            "result_status = ?, result_headers = ?, result_body = ? "
            "WHERE id = ? AND status = ?",
            (end.value, time.time(), status, json.dumps(headers), body, job_id,
             JobStatus.RUNNING.value)).rowcount == 1

    def set_callback_status(self, job_id: str, status: str) -> None:
        self._tx("UPDATE jobs SET callback_status = ? WHERE id = ?", (status, job_id))

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, tenant, path, headers, body, status, attempts, completions, "
                "created_at, finished_at, result_status, result_headers, result_body, "
                "callback_url, callback_status FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        return Job(id=row[0], tenant=row[1], path=row[2], headers=json.loads(row[3]),
                   body=row[4], status=JobStatus(row[5]), attempts=row[6], completions=row[7],
                   created_at=row[8], finished_at=row[9], result_status=row[10],
                   result_headers=json.loads(row[11]) if row[11] else None,
                   result_body=row[12], callback_url=row[13], callback_status=row[14])

    def count(self, status: JobStatus) -> int:
        return int(self._tx("SELECT COUNT(*) FROM jobs WHERE status = ?",
                            (status.value,)).fetchone()[0])


_COMPLETE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[2], 'result_status', ARGV[3],
           'result_headers', ARGV[4], 'result_body', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'completions', 1)
redis.call('LREM', KEYS[2], 0, ARGV[6])
return 1
"""
_RECOVER = """
local n = 0
while true do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
  if not id then return n end
  redis.call('HSET', ARGV[1] .. id, 'status', 'queued')
  n = n + 1
end
"""


class RedisJobStore:
    """The same contract on Redis, for replicas that share their jobs: a hash per job, a
    ``queued`` and a ``running`` list; claiming is an atomic LMOVE, completing a Lua script
    that only moves a running job (exactly once, whichever replica finishes first)."""

    def __init__(self, url: str, prefix: str = "sokuji:") -> None:
        import redis

        self._r: Any = redis.Redis.from_url(url)
        self._job = f"{prefix}job:"
        self._queued = f"{prefix}jobs:queued"
        self._running = f"{prefix}jobs:running"
        self._complete = self._r.register_script(_COMPLETE)
        self._recover = self._r.register_script(_RECOVER)
        self._r.ping()

    def close(self) -> None:
        self._r.close()

    def submit(self, tenant: str, path: str, headers: dict[str, str], body: bytes,
               callback_url: str | None = None) -> str:
        job_id = uuid.uuid4().hex
        fields: dict[str, Any] = {"tenant": tenant, "path": path,
                                  "headers": json.dumps(headers), "body": body,
                                  "status": JobStatus.QUEUED.value, "attempts": 0,
                                  "completions": 0, "created_at": time.time()}
        if callback_url:
            fields["callback_url"] = callback_url
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(self._job + job_id, mapping=fields)
        pipe.rpush(self._queued, job_id)
        pipe.execute()
        return job_id

    def recover(self) -> int:
        return int(self._recover(keys=[self._running, self._queued], args=[self._job]))

    def claim(self) -> Job | None:
        raw = self._r.lmove(self._queued, self._running, "LEFT", "RIGHT")
        if raw is None:
            return None
        job_id = raw.decode()
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(self._job + job_id, "status", JobStatus.RUNNING.value)
        pipe.hincrby(self._job + job_id, "attempts", 1)
        pipe.execute()
        return self.get(job_id)

    def complete(self, job_id: str, status: int, headers: dict[str, str], body: bytes) -> bool:
        end = JobStatus.DONE if status < 400 else JobStatus.FAILED
        return bool(self._complete(keys=[self._job + job_id, self._running],
                                   args=[end.value, time.time(), status, json.dumps(headers),
                                         body, job_id]))

    def set_callback_status(self, job_id: str, status: str) -> None:
        self._r.hset(self._job + job_id, "callback_status", status)

    def get(self, job_id: str) -> Job | None:
        h = self._r.hgetall(self._job + job_id)
        if not h:
            return None

        def text(key: str) -> str | None:
            value = h.get(key.encode())
            return None if value is None else value.decode()

        result_headers = text("result_headers")
        result_status = text("result_status")
        finished_at = text("finished_at")
        return Job(id=job_id, tenant=text("tenant") or "", path=text("path") or "",
                   headers=json.loads(text("headers") or "{}"), body=h.get(b"body", b""),
                   status=JobStatus(text("status") or "queued"),
                   attempts=int(text("attempts") or 0),
                   completions=int(text("completions") or 0),
                   created_at=float(text("created_at") or 0),
                   finished_at=float(finished_at) if finished_at else None,
                   result_status=int(result_status) if result_status else None,
                   result_headers=json.loads(result_headers) if result_headers else None,
                   result_body=h.get(b"result_body"), callback_url=text("callback_url"),
                   callback_status=text("callback_status"))

    def count(self, status: JobStatus) -> int:
        if status is JobStatus.QUEUED:
            return int(self._r.llen(self._queued))
        if status is JobStatus.RUNNING:
            return int(self._r.llen(self._running))
        return sum(1 for key in self._r.scan_iter(f"{self._job}*")
                   if self._r.hget(key, "status") == status.value.encode())
