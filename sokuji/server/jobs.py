"""Asynchronous inference over HTTP: ``Prefer: respond-async`` gives 202 and a job to poll.

- Submit: any inference request (V2 infer or ``/v1/embeddings``) with
  ``Prefer: respond-async`` is authorised, checked, counted against its tenant's quota of
  unfinished jobs (``max_pending_jobs`` of its key, else ``jobs.max_pending_per_tenant``:
  429 with Retry-After beyond it), written to the job store, and answered ``202 Accepted``
  with ``Location: /v2/jobs/{id}``. Optional ``X-Sokuji-Callback-Url`` receives the result by
  a signed POST; the URL is vetted at once (400) and again at delivery (``callbacks.py``,
  ``callback_delivery.py``).
- Poll: ``GET /v2/jobs/{id}`` gives the status; ``GET /v2/jobs/{id}/result`` gives the stored
  response exactly as the synchronous call would have (202 with the status until then).
  Another tenant's job is a 404, and so is a job that finished more than
  ``jobs.result_ttl_s`` ago (a clean-up task deletes them).
- Run: one dispatcher claims queued jobs while fewer than ``jobs.concurrency`` run, and sends
  each through the same inference path as live requests, at ``batch`` priority unless the
  request said otherwise, so interactive traffic goes first. An answer of 429, 503 or 504 is
  transient: the job goes back in the queue after an exponential backoff (at least the
  answer's Retry-After), until it has run ``jobs.max_attempts`` times; then that answer is
  its result.
- Store I/O runs in a small thread pool, never on the event loop. A store outage answers 503
  (``StoreUnavailable``), never 500; the runner waits it out and loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from starlette.types import Receive

from sokuji.config import ServerConfig
from sokuji.core.jobs import Job, JobStatus, JobStoreProtocol
from sokuji.errors import ConfigError, NotFound, Overloaded, StoreUnavailable
from sokuji.server.auth import Authenticator, Tenant
from sokuji.server.callback_delivery import CallbackSender, load_or_create_secret, payload
from sokuji.server.callbacks import CALLBACK_HEADER, CallbackPolicy
from sokuji.server.http import Headers, Reply, json_reply, read_body

log = logging.getLogger(__name__)
JOBS_PREFIX = "/v2/jobs/"
KEPT_HEADERS = ("content-type", "inference-header-content-length", "x-sokuji-priority",
                "cache-control")
TRANSIENT = frozenset({429, 503, 504})
RETRY_BASE_S = 0.5
"""First backoff of a transient answer; it doubles with each run, up to ``RETRY_MAX_S``."""
RETRY_MAX_S = 60.0
QUOTA_RETRY_AFTER_S = 1
IDLE_POLL_S = 1.0
"""An idle runner looks for work this often: due retries, and jobs other replicas queued."""
PURGE_EVERY_S = 60.0
STORE_THREADS = 4
STORE_BACKOFF_S = (0.1, 5.0)
"""The runner's waits while the store is down: from the first, doubling, to the last."""
_JOB_ID = re.compile(r"[0-9a-f]{32}")

Respond = Callable[..., Awaitable[Reply | None]]
CheckModel = Callable[[str, bytes, Tenant], None]
T = TypeVar("T")


class JobService:
    def __init__(self, store: JobStoreProtocol, auth: Authenticator,
                 config: ServerConfig) -> None:
        j = config.jobs
        self.store = store
        self.auth = auth
        self.jobs = j
        self.cache_dir = config.cache_dir
        self.max_request_bytes = config.max_request_bytes
        self.quota: dict[str, int] = {}
        tenant_secrets: dict[str, str] = {}
        for key in config.api_keys:
            if key.max_pending_jobs:
                self.quota.setdefault(key.tenant, key.max_pending_jobs)
            if key.callback_secret:
                tenant_secrets.setdefault(key.tenant, key.callback_secret)
        self.callbacks = CallbackSender(CallbackPolicy(j.callback_allow, j.callback_timeout_s),
                                        j.callback_secret, tenant_secrets, j.callback_timeout_s)
        self._pool = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="sokuji-jobs")
        self._respond: Respond | None = None
        self._check: CheckModel | None = None
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (a store call) in the store's threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))

    async def _patiently(self, fn: Callable[..., T], *args: Any) -> T:
        """A store call for the runner: while the store is unavailable, wait and try again
        (work already accepted must not be dropped because Redis blinked)."""
        wait_s = STORE_BACKOFF_S[0]
        while True:
            try:
                return await self._io(fn, *args)
            except StoreUnavailable:
                await asyncio.sleep(wait_s)
                wait_s = min(STORE_BACKOFF_S[1], wait_s * 2)

    # --- HTTP ------------------------------------------------------------------------------
    async def submit(self, path: str, headers: Headers, receive: Receive,
                     tenant: Tenant) -> Reply:
        """``POST`` with ``Prefer: respond-async`` by ``tenant`` (authenticated by the app)."""
        callback = headers.get(CALLBACK_HEADER)
        if callback is not None:
            await self.callbacks.check(callback)
        body = await read_body(receive, headers, self.max_request_bytes)
        if self._check is not None:
            self._check(path, body, tenant)
        kept = {k: headers[k] for k in KEPT_HEADERS if k in headers}
        limit = self.quota.get(tenant.name, self.jobs.max_pending_per_tenant)
        job_id = await self._io(self.store.submit, tenant.name, path, kept, body, callback,
                                limit)
        if job_id is None:
            raise Overloaded(f"tenant '{tenant.name}' already has {limit} unfinished jobs "
                             "(queued or running): submit more when some have finished",
                             retry_after_s=QUOTA_RETRY_AFTER_S)
        self._wake.set()
        location = f"{JOBS_PREFIX}{job_id}"
        return json_reply({"id": job_id, "status": JobStatus.QUEUED.value,
                           "location": location}, 202,
                          {"location": location, "preference-applied": "respond-async"})

    async def status(self, path: str, tenant: Tenant) -> Reply:
        """``GET`` of a job or its result by ``tenant`` (authenticated by the app)."""
        rest = path[len(JOBS_PREFIX):].split("/")
        if not _JOB_ID.fullmatch(rest[0]) or rest[1:] not in ([], ["result"]):
            raise NotFound(f"no job at {path}")
        job = await self._io(self.store.get, rest[0])
        if job is None or (self.auth.enabled and job.tenant != tenant.name):
            raise NotFound(f"no job at {path}")
        doc = self._describe(job)
        if rest[1:] == ["result"]:
            if job.result_status is None or job.result_body is None:
                return json_reply(doc, 202)
            return Reply(job.result_status, job.result_body, job.result_headers or {})
        return json_reply(doc)

    def _describe(self, job: Job) -> dict[str, Any]:
        callback = None
        if job.callback_url:  # delivered | failed | refused: <policy>; never the remote's words
            callback = job.callback_status or "pending"
        expires = None if job.finished_at is None else job.finished_at + self.store.result_ttl_s
        return {"id": job.id, "status": job.status.value, "attempts": job.attempts,
                "created_at": job.created_at, "finished_at": job.finished_at,
                "expires_at": expires, "result": f"{JOBS_PREFIX}{job.id}/result",
                "callback": callback}

    # --- running ---------------------------------------------------------------------------
    def start(self, respond: Respond, check: CheckModel) -> None:
        """Run jobs through ``respond`` (the inference path); ``check`` vets submissions."""
        self._respond = respond
        self._check = check
        if not self.callbacks.default_secret:
            path = Path(self.cache_dir) / "callback_secret"
            try:
                self.callbacks.default_secret = load_or_create_secret(path)
            except OSError as exc:
                raise ConfigError.for_key("cache_dir", self.cache_dir, "cannot keep the "
                                          f"callback secret there ({exc.strerror}); set "
                                          "jobs.callback_secret") from None
        self._spawn(self._dispatch())
        self._spawn(self._housekeep())

    async def stop(self) -> None:
        """Stop running jobs; unfinished ones stay in the store and run after a restart."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await asyncio.to_thread(self._pool.shutdown)  # store calls in flight finish first
        await asyncio.to_thread(self.store.close)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("jobs: task failed", exc_info=task.exception())

    async def _dispatch(self) -> None:
        """Claim jobs while a slot is free; sleep until a submission, a due retry, or the
        idle poll."""
        recovered = await self._patiently(self.store.recover)
        if recovered:
            log.info("jobs: %d interrupted job(s) queued again", recovered)
        slots = asyncio.Semaphore(self.jobs.concurrency)
        while True:
            await slots.acquire()
            self._wake.clear()  # before claiming: a submission from now on sets it again
            job = await self._patiently(self.store.claim)
            if job is None:
                slots.release()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
                continue
            task = self._spawn(self._process(job))
            task.add_done_callback(lambda _: slots.release())

    async def _process(self, job: Job) -> None:
        reply = await self._run(job)
        if reply is None:  # cannot happen: a job's request never disconnects
            return
        if reply.status in TRANSIENT and job.attempts < self.jobs.max_attempts:
            delay_s = backoff_s(job.attempts, reply.headers.get("retry-after"))
            if await self._patiently(self.store.retry, job.id, delay_s):
                log.info("job %s: answer %d, run %d of %d again in %.1f s", job.id,
                         reply.status, job.attempts + 1, self.jobs.max_attempts, delay_s)
                asyncio.get_running_loop().call_later(delay_s, self._wake.set)
            return
        if await self._patiently(self.store.complete, job.id, reply.status, reply.headers,
                                 reply.body) and job.callback_url:
            self._spawn(self._callback(job, reply))

    async def _run(self, job: Job) -> Reply | None:
        assert self._respond is not None
        headers = dict(job.headers)
        headers.setdefault("x-sokuji-priority", "batch")
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()  # nothing more will come
            sent = True
            return {"type": "http.request", "body": job.body, "more_body": False}

        tenant = self.auth.tenant(job.tenant)
        return await self._respond("POST", job.path, headers, receive, time.perf_counter_ns(),
                                   tenant)

    async def _callback(self, job: Job, reply: Reply) -> None:
        assert job.callback_url is not None
        body = payload(job.id, reply.status, reply.headers, reply.body)
        outcome = await self.callbacks.deliver(job.tenant, job.id, job.callback_url, body)
        await self._patiently(self.store.set_callback_status, job.id, outcome)

    async def _housekeep(self) -> None:
        """Delete finished jobs past their TTL, every ``PURGE_EVERY_S`` (or half the TTL)."""
        every_s = min(PURGE_EVERY_S, max(1.0, self.store.result_ttl_s / 2))
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(StoreUnavailable):  # logged by the store; next round
                purged = await self._io(self.store.purge)
                if purged:
                    log.info("jobs: %d finished job(s) past jobs.result_ttl_s deleted", purged)


def backoff_s(attempts: int, retry_after: str | None) -> float:
    """The wait before run ``attempts + 1``: doubling from ``RETRY_BASE_S``, at least the
    answer's Retry-After (seconds), at most ``RETRY_MAX_S``; with up to 25% jitter so jobs
    refused together do not come back together."""
    delay = RETRY_BASE_S * 2 ** max(0, attempts - 1)
    if retry_after is not None and retry_after.strip().isdigit():
        delay = max(delay, float(retry_after.strip()))
    return min(RETRY_MAX_S, delay) * random.uniform(1.0, 1.25)
