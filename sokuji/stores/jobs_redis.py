"""The job store's contract (``core/job.py``; described in ``jobs_sqlite.py``) on Redis, for
replicas that share their jobs.

Layout under the prefix ``P``: a hash per job (``P job:<id>``); ``P jobs:queued`` (a list, in
line), ``P jobs:leases`` (running jobs, scored by when their lease ends) and
``P jobs:delayed`` (retries, scored by when they may run); per tenant, ``P jobs:pending:<t>``
(its unfinished job ids: the quota), ``P jobs:bytes:<t>`` (its stored bytes),
``P jobs:results:<t>`` (``<id>:<bytes>`` of its results, scored by when they expire, so their
bytes stop counting then) and ``P jobs:cb:<t>`` (its due callbacks, scored by when they are
due); ``P jobs:tenants`` and ``P jobs:cb-tenants`` list the tenants of those sets.

Every state change is one Lua script, so it is atomic whichever replica runs it. Timestamps
come from the caller's clock: replicas' clocks must agree to well within a lease.

The client never retries a command by itself: a command that timed out may have run, and a
second ``submit`` would queue the job twice. Every call is bounded by ``timeout_s``. What a
lost reply leaves is safe: a lost claim is a job whose lease nobody renews (``recover`` frees
it), a lost completion is answered True when asked again, and a completion's callback is due
in the store whatever the caller heard.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from sokuji.core.job import (
    CALLBACK_PENDING,
    DEFAULT_LEASE_S,
    DEFAULT_RESULT_TTL_S,
    Clock,
    Job,
    JobStatus,
    QuotaHit,
    Usage,
    translated,
)

_CLEAN = """
local function clean(results, bytes, now, most)
  local gone = redis.call('ZRANGEBYSCORE', results, '-inf', now, 'LIMIT', 0, most)
  if #gone == 0 then return 0 end
  local freed = 0
  for _, m in ipairs(gone) do freed = freed + tonumber(string.match(m, ':(%d+)$')) end
  redis.call('ZREM', results, unpack(gone))
  redis.call('DECRBY', bytes, freed)
  return #gone
end
"""
_SUBMIT = _CLEAN + """
clean(KEYS[5], KEYS[4], ARGV[5], 100)
local limit = tonumber(ARGV[1])
if limit > 0 and redis.call('SCARD', KEYS[3]) >= limit then return 0 end
local max_bytes = tonumber(ARGV[2])
if max_bytes > 0 and tonumber(redis.call('GET', KEYS[4]) or '0') + tonumber(ARGV[4])
    > max_bytes then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('INCRBY', KEYS[4], ARGV[4])
return 1
"""
_USAGE = _CLEAN + """
clean(KEYS[3], KEYS[2], ARGV[1], 100)
return {redis.call('SCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[2]) or '0')}
"""
_CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[2], 'LIMIT', 0, 100)
for i = #due, 1, -1 do
  redis.call('ZREM', KEYS[3], due[i])
  redis.call('LPUSH', KEYS[1], due[i])
end
for _ = 1, 100 do
  local id = redis.call('LPOP', KEYS[1])
  if not id then return false end
  local key = ARGV[1] .. id
  if redis.call('HGET', key, 'status') == 'queued' then
    redis.call('HSET', key, 'status', 'running', 'runner', ARGV[4])
    redis.call('HINCRBY', key, 'attempts', 1)
    redis.call('ZADD', KEYS[2], ARGV[3], id)
    return id
  end  -- else a stale entry (its job ended or is gone): dropped
end
return false
"""
_RENEW = """
local n = 0
for i = 4, #ARGV do
  local key = ARGV[1] .. ARGV[i]
  if redis.call('HGET', key, 'status') == 'running'
      and redis.call('HGET', key, 'runner') == ARGV[3] then
    redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i])
    n = n + 1
  end
end
return n
"""
_REQUEUE = """
local function requeue(id)
  redis.call('ZREM', KEYS[1], id)
  local key = ARGV[1] .. id
  if redis.call('HGET', key, 'status') ~= 'running' then return 0 end
  redis.call('HSET', key, 'status', 'queued', 'runner', '')
  redis.call('LPUSH', KEYS[2], id)
  return 1
end
"""
_RECOVER = _REQUEUE + """
local n = 0
while true do  -- the running list of a store written by an older version
  local id = redis.call('LPOP', KEYS[3])
  if not id then break end
  n = n + requeue(id)
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'LIMIT', 0, 1000)
for i = #expired, 1, -1 do n = n + requeue(expired[i]) end
return n
"""
_RELEASE = _REQUEUE + """
local n = 0
for i = 3, #ARGV do
  if redis.call('HGET', ARGV[1] .. ARGV[i], 'runner') == ARGV[2] then
    n = n + requeue(ARGV[i])
  end
end
return n
"""
_RETRY = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running'
    or redis.call('HGET', KEYS[1], 'runner') ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'runner', '')
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[1], ARGV[2])
return 1
"""
_COMPLETE = """
local status = redis.call('HGET', KEYS[1], 'status')
if redis.call('HGET', KEYS[1], 'runner') ~= ARGV[9] then return 0 end
if status ~= 'running' then
  if status == 'done' or status == 'failed' then return 1 end  -- mine: a repeated call
  return 0
end
local base, id, now = ARGV[8], ARGV[6], ARGV[2]
local tenant = redis.call('HGET', KEYS[1], 'tenant')
local size = string.len(ARGV[5])
local old = tonumber(redis.call('HGET', KEYS[1], 'stored') or '0')
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', now, 'result_status', ARGV[3],
           'result_headers', ARGV[4], 'result_body', ARGV[5], 'body', '', 'stored', size)
redis.call('HINCRBY', KEYS[1], 'completions', 1)
redis.call('ZREM', KEYS[2], id)
redis.call('SREM', base .. 'pending:' .. tenant, id)
redis.call('INCRBY', base .. 'bytes:' .. tenant, size - old)
if size > 0 then
  redis.call('ZADD', base .. 'results:' .. tenant, ARGV[10], id .. ':' .. size)
  redis.call('SADD', base .. 'tenants', tenant)
end
if redis.call('HEXISTS', KEYS[1], 'callback_url') == 1 then
  redis.call('HSET', KEYS[1], 'callback_status', ARGV[11], 'callback_next_at', now)
  redis.call('ZADD', base .. 'cb:' .. tenant, now, id)
  redis.call('SADD', base .. 'cb-tenants', tenant)
end
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return 1
"""
_DUE = """
local out = {}
for _, t in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local due = ARGV[1] .. 'cb:' .. t
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', due, '-inf', ARGV[2], 'LIMIT', 0, ARGV[3])) do
    if redis.call('EXISTS', ARGV[4] .. id) == 1 then
      table.insert(out, id)
      table.insert(out, t)
    else
      redis.call('ZREM', due, id)  -- the job expired
    end
  end
  if redis.call('ZCARD', due) == 0 then redis.call('SREM', KEYS[1], t) end
end
return out
"""
_TAKE = """
local tenant = redis.call('HGET', KEYS[1], 'tenant')
if not tenant then return 0 end
local due = ARGV[1] .. 'cb:' .. tenant
local at = redis.call('ZSCORE', due, ARGV[4])
if not at or tonumber(at) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', due, ARGV[3], ARGV[4])
redis.call('HSET', KEYS[1], 'callback_next_at', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'callback_attempts', 1)
return 1
"""
_SET_CALLBACK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end  -- never revives an expired job
local tenant = redis.call('HGET', KEYS[1], 'tenant')
local due = ARGV[3] .. 'cb:' .. tenant
if ARGV[2] == '' then
  redis.call('HSET', KEYS[1], 'callback_status', ARGV[1])
  redis.call('HDEL', KEYS[1], 'callback_next_at')
  redis.call('ZREM', due, ARGV[4])
  if redis.call('ZCARD', due) == 0 then redis.call('SREM', KEYS[2], tenant) end
else
  redis.call('HSET', KEYS[1], 'callback_status', ARGV[1], 'callback_next_at', ARGV[2])
  redis.call('ZADD', due, ARGV[2], ARGV[4])
  redis.call('SADD', KEYS[2], tenant)
end
return 1
"""
_PURGE = _CLEAN + """
local n = 0
for _, t in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local results = ARGV[1] .. 'results:' .. t
  n = n + clean(results, ARGV[1] .. 'bytes:' .. t, ARGV[2], 1000)
  if redis.call('ZCARD', results) == 0 then redis.call('SREM', KEYS[1], t) end
end
return n
"""


def _redis_errors(store: RedisJobStore) -> tuple[type[BaseException], ...]:
    return store._errors


class RedisJobStore:
    """A hash per job, a queue, leases, delayed retries, per-tenant quotas, bytes and due
    callbacks (module docstring)."""

    def __init__(self, url: str, prefix: str = "sokuji:", timeout_s: float = 2.0,
                 result_ttl_s: float = DEFAULT_RESULT_TTL_S, lease_s: float = DEFAULT_LEASE_S,
                 clock: Clock = time.time) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError,)
        self.result_ttl_s = result_ttl_s
        self.lease_s = lease_s
        self.runner = uuid.uuid4().hex
        self._clock = clock
        self._r: Any = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0),
                                            health_check_interval=30)
        self._job = f"{prefix}job:"
        self._base = f"{prefix}jobs:"
        self._queued = f"{prefix}jobs:queued"
        self._leases = f"{prefix}jobs:leases"
        self._legacy_running = f"{prefix}jobs:running"
        self._delayed = f"{prefix}jobs:delayed"
        self._cb_tenants = f"{prefix}jobs:cb-tenants"
        scripts = {"submit": _SUBMIT, "usage": _USAGE, "claim": _CLAIM, "renew": _RENEW,
                   "recover": _RECOVER, "release": _RELEASE, "retry": _RETRY,
                   "complete": _COMPLETE, "due": _DUE, "take": _TAKE,
                   "set_callback": _SET_CALLBACK, "purge": _PURGE}
        self._lua = {name: self._r.register_script(text) for name, text in scripts.items()}
        self._r.ping()

    def close(self) -> None:
        self._r.close()

    def _tenant_keys(self, tenant: str) -> tuple[str, str, str]:
        """The tenant's pending set, bytes counter and results set."""
        return (f"{self._base}pending:{tenant}", f"{self._base}bytes:{tenant}",
                f"{self._base}results:{tenant}")

    @translated(_redis_errors, "redis")
    def submit(self, tenant: str, path: str, headers: dict[str, str], body: bytes,
               callback_url: str | None = None, max_pending: int = 0, *,
               key_id: str | None = None, max_bytes: int = 0) -> str | QuotaHit:
        job_id = uuid.uuid4().hex
        now = self._clock()
        fields: dict[str, Any] = {"tenant": tenant, "path": path,
                                  "headers": json.dumps(headers), "body": body,
                                  "status": JobStatus.QUEUED.value, "attempts": 0,
                                  "completions": 0, "created_at": now, "stored": len(body)}
        if callback_url:
            fields["callback_url"] = callback_url
        if key_id is not None:
            fields["key_id"] = key_id
        flat = [x for pair in fields.items() for x in pair]
        pending, counted, results = self._tenant_keys(tenant)
        added = self._lua["submit"](
            keys=[self._job + job_id, self._queued, pending, counted, results],
            args=[max(0, max_pending), max(0, max_bytes), job_id, len(body), now, *flat])
        if added == 0:
            return QuotaHit.PENDING
        if added == -1:
            return QuotaHit.BYTES
        return job_id

    @translated(_redis_errors, "redis")
    def recover(self) -> int:
        return int(self._lua["recover"](keys=[self._leases, self._queued, self._legacy_running],
                                        args=[self._job, self._clock()]))

    @translated(_redis_errors, "redis")
    def claim(self) -> Job | None:
        now = self._clock()
        raw = self._lua["claim"](keys=[self._queued, self._leases, self._delayed],
                                 args=[self._job, now, now + self.lease_s, self.runner])
        return None if raw is None else self.get(raw.decode())

    @translated(_redis_errors, "redis")
    def renew(self, job_ids: Sequence[str]) -> int:
        if not job_ids:
            return 0
        return int(self._lua["renew"](keys=[self._leases], args=[
            self._job, self._clock() + self.lease_s, self.runner, *job_ids]))

    @translated(_redis_errors, "redis")
    def release(self, job_ids: Sequence[str]) -> int:
        if not job_ids:
            return 0
        return int(self._lua["release"](keys=[self._leases, self._queued],
                                        args=[self._job, self.runner, *job_ids]))

    @translated(_redis_errors, "redis")
    def retry(self, job_id: str, delay_s: float) -> bool:
        return bool(self._lua["retry"](keys=[self._job + job_id, self._leases, self._delayed],
                                       args=[self._clock() + delay_s, job_id, self.runner]))

    @translated(_redis_errors, "redis")
    def complete(self, job_id: str, status: int, headers: dict[str, str], body: bytes) -> bool:
        end = JobStatus.DONE if status < 400 else JobStatus.FAILED
        now = self._clock()
        ttl_ms = max(1, int(self.result_ttl_s * 1000))
        return bool(self._lua["complete"](
            keys=[self._job + job_id, self._leases],
            args=[end.value, now, status, json.dumps(headers), body, job_id, ttl_ms,
                  self._base, self.runner, now + self.result_ttl_s, CALLBACK_PENDING]))

    @translated(_redis_errors, "redis")
    def due_callbacks(self, per_tenant: int) -> list[tuple[str, str]]:
        flat = self._lua["due"](keys=[self._cb_tenants],
                                args=[self._base, self._clock(), per_tenant, self._job])
        items = [x.decode() for x in flat]
        return list(zip(items[::2], items[1::2], strict=True))

    @translated(_redis_errors, "redis")
    def take_callback(self, job_id: str, lease_s: float) -> Job | None:
        now = self._clock()
        taken = self._lua["take"](keys=[self._job + job_id],
                                  args=[self._base, now, now + lease_s, job_id])
        return self.get(job_id) if taken else None

    @translated(_redis_errors, "redis")
    def set_callback_status(self, job_id: str, status: str,
                            retry_in_s: float | None = None) -> None:
        next_at = "" if retry_in_s is None else repr(self._clock() + retry_in_s)
        self._lua["set_callback"](keys=[self._job + job_id, self._cb_tenants],
                                  args=[status, next_at, self._base, job_id])

    @translated(_redis_errors, "redis")
    def get(self, job_id: str) -> Job | None:
        h = self._r.hgetall(self._job + job_id)
        if not h:
            return None

        def text(key: str) -> str | None:
            value = h.get(key.encode())
            return None if value is None else value.decode()

        def number(key: str) -> float | None:
            value = text(key)
            return float(value) if value else None

        result_headers = text("result_headers")
        result_status = text("result_status")
        return Job(id=job_id, tenant=text("tenant") or "", path=text("path") or "",
                   headers=json.loads(text("headers") or "{}"), body=h.get(b"body", b""),
                   status=JobStatus(text("status") or "queued"),
                   attempts=int(text("attempts") or 0),
                   completions=int(text("completions") or 0),
                   created_at=float(text("created_at") or 0), finished_at=number("finished_at"),
                   result_status=int(result_status) if result_status else None,
                   result_headers=json.loads(result_headers) if result_headers else None,
                   result_body=h.get(b"result_body"), callback_url=text("callback_url"),
                   callback_status=text("callback_status"), key_id=text("key_id"),
                   runner=text("runner") or None,
                   callback_attempts=int(text("callback_attempts") or 0),
                   callback_next_at=number("callback_next_at"))

    @translated(_redis_errors, "redis")
    def pending(self, tenant: str) -> int:
        return int(self._r.scard(self._tenant_keys(tenant)[0]))

    @translated(_redis_errors, "redis")
    def usage(self, tenant: str) -> Usage:
        pending, stored = self._lua["usage"](keys=list(self._tenant_keys(tenant)),
                                             args=[self._clock()])
        return Usage(int(pending), int(stored))

    @translated(_redis_errors, "redis")
    def purge(self) -> int:
        """Finished jobs' hashes expire by themselves (PEXPIRE); this stops counting the bytes
        of expired results. Returns how many results stopped counting."""
        return int(self._lua["purge"](keys=[f"{self._base}tenants"],
                                      args=[self._base, self._clock()]))

    def count(self, status: JobStatus) -> int:
        if status is JobStatus.QUEUED:
            return int(self._r.llen(self._queued)) + int(self._r.zcard(self._delayed))
        if status is JobStatus.RUNNING:
            return int(self._r.zcard(self._leases))
        return sum(1 for key in self._r.scan_iter(f"{self._job}*")
                   if self._r.hget(key, "status") == status.value.encode())
