"""The job store's contract (``core/jobs.py``) on Redis, for replicas that share their jobs.

Layout under the prefix: a hash per job (``job:<id>``), a ``queued`` and a ``running`` list, a
``delayed`` sorted set (jobs waiting to be retried, scored by the time they may run), and a set
of unfinished job ids per tenant (``pending:<tenant>``, the quota). Every state change is one
Lua script, so it is atomic whichever replica runs it: claiming moves due retries back into
line and then one queued job to ``running``; completing only moves a ``running`` job (exactly
once, whichever replica finishes first) and sets the hash to expire after ``result_ttl_s``.

The client never retries a command by itself: a command that timed out may have run, and a
second ``submit`` would queue the job twice. Every call is bounded by ``timeout_s``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from sokuji.core.jobs import DEFAULT_RESULT_TTL_S, Job, JobStatus, translated

_SUBMIT = """
local limit = tonumber(ARGV[1])
if limit > 0 and redis.call('SCARD', KEYS[3]) >= limit then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""
_CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[2], 'LIMIT', 0, 100)
for i = #due, 1, -1 do
  redis.call('ZREM', KEYS[3], due[i])
  redis.call('LPUSH', KEYS[1], due[i])
end
for _ = 1, 100 do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then return false end
  local key = ARGV[1] .. id
  if redis.call('HGET', key, 'status') == 'queued' then
    redis.call('HSET', key, 'status', 'running')
    redis.call('HINCRBY', key, 'attempts', 1)
    return id
  end
  redis.call('LREM', KEYS[2], -1, id)  -- a stale entry (its job ended or is gone)
end
return false
"""
_RETRY = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('LREM', KEYS[2], 0, ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[1], ARGV[2])
return 1
"""
_COMPLETE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[2], 'result_status', ARGV[3],
           'result_headers', ARGV[4], 'result_body', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'completions', 1)
redis.call('LREM', KEYS[2], 0, ARGV[6])
redis.call('SREM', ARGV[8] .. redis.call('HGET', KEYS[1], 'tenant'), ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
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
_SET_CALLBACK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'callback_status', ARGV[1])
return 1
"""


def _redis_errors(store: RedisJobStore) -> tuple[type[BaseException], ...]:
    return store._errors


class RedisJobStore:
    """A hash per job, ``queued``/``running`` lists, a ``delayed`` set, per-tenant quotas."""

    def __init__(self, url: str, prefix: str = "sokuji:", timeout_s: float = 2.0,
                 result_ttl_s: float = DEFAULT_RESULT_TTL_S) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError,)
        self.result_ttl_s = result_ttl_s
        self._r: Any = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0),
                                            health_check_interval=30)
        self._job = f"{prefix}job:"
        self._queued = f"{prefix}jobs:queued"
        self._running = f"{prefix}jobs:running"
        self._delayed = f"{prefix}jobs:delayed"
        self._pending = f"{prefix}jobs:pending:"
        self._submit = self._r.register_script(_SUBMIT)
        self._claim = self._r.register_script(_CLAIM)
        self._retry = self._r.register_script(_RETRY)
        self._complete = self._r.register_script(_COMPLETE)
        self._recover = self._r.register_script(_RECOVER)
        self._set_callback = self._r.register_script(_SET_CALLBACK)
        self._r.ping()

    def close(self) -> None:
        self._r.close()

    @translated(_redis_errors, "redis")
    def submit(self, tenant: str, path: str, headers: dict[str, str], body: bytes,
               callback_url: str | None = None, max_pending: int = 0) -> str | None:
        job_id = uuid.uuid4().hex
        fields: dict[str, Any] = {"tenant": tenant, "path": path,
                                  "headers": json.dumps(headers), "body": body,
                                  "status": JobStatus.QUEUED.value, "attempts": 0,
                                  "completions": 0, "created_at": time.time()}
        if callback_url:
            fields["callback_url"] = callback_url
        flat = [x for pair in fields.items() for x in pair]
        added = self._submit(keys=[self._job + job_id, self._queued, self._pending + tenant],
                             args=[max(0, max_pending), job_id, *flat])
        return job_id if added else None

    @translated(_redis_errors, "redis")
    def recover(self) -> int:
        return int(self._recover(keys=[self._running, self._queued], args=[self._job]))

    @translated(_redis_errors, "redis")
    def claim(self) -> Job | None:
        raw = self._claim(keys=[self._queued, self._running, self._delayed],
                          args=[self._job, time.time()])
        return None if raw is None else self.get(raw.decode())

    @translated(_redis_errors, "redis")
    def retry(self, job_id: str, delay_s: float) -> bool:
        return bool(self._retry(keys=[self._job + job_id, self._running, self._delayed],
                                args=[time.time() + delay_s, job_id]))

    @translated(_redis_errors, "redis")
    def complete(self, job_id: str, status: int, headers: dict[str, str], body: bytes) -> bool:
        end = JobStatus.DONE if status < 400 else JobStatus.FAILED
        ttl_ms = max(1, int(self.result_ttl_s * 1000))
        return bool(self._complete(keys=[self._job + job_id, self._running],
                                   args=[end.value, time.time(), status, json.dumps(headers),
                                         body, job_id, ttl_ms, self._pending]))

    @translated(_redis_errors, "redis")
    def set_callback_status(self, job_id: str, status: str) -> None:
        self._set_callback(keys=[self._job + job_id], args=[status])  # never revives a job

    @translated(_redis_errors, "redis")
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

    @translated(_redis_errors, "redis")
    def pending(self, tenant: str) -> int:
        return int(self._r.scard(self._pending + tenant))

    def purge(self) -> int:
        """Nothing to do: finished jobs' hashes expire by themselves (PEXPIRE)."""
        return 0

    def count(self, status: JobStatus) -> int:
        if status is JobStatus.QUEUED:
            return int(self._r.llen(self._queued)) + int(self._r.zcard(self._delayed))
        if status is JobStatus.RUNNING:
            return int(self._r.llen(self._running))
        return sum(1 for key in self._r.scan_iter(f"{self._job}*")
                   if self._r.hget(key, "status") == status.value.encode())
