"""Asynchronous inference over HTTP: ``Prefer: respond-async`` gives 202 and a job to poll.

- Submit: any inference request (V2 infer or ``/v1/embeddings``) with
  ``Prefer: respond-async`` is authenticated, its callback URL's shape checked, its body read
  and its model checked. Its priority is settled now: ``X-Sokuji-Priority`` (default
  ``batch``) under its key's ceiling, kept with the job. It counts against its tenant's quotas
  (429 with Retry-After beyond them): ``max_pending_jobs`` of its key, else
  ``jobs.max_pending_per_tenant``, unfinished jobs; and ``jobs.max_stored_bytes_per_tenant`` bytes
  kept in the store (request bodies of unfinished jobs, results of finished ones until they
  expire). With ``X-Sokuji-Callback-Url``, the quotas are checked before the host is looked
  up (lookups are bounded per tenant: ``callbacks.py``). The job is written with the identity
  of the key that submitted it (``auth.key_id``) and answered ``202 Accepted`` with
  ``Location: /v2/jobs/{id}``.
- Poll: ``GET /v2/jobs/{id}`` gives the status; ``GET /v2/jobs/{id}/result`` gives the stored
  response exactly as the synchronous call would have (202 with the status until then).
  Another tenant's job is a 404, and so is, once keys are configured, a job stored while the
  server needed none, and a job that finished more than ``jobs.result_ttl_s`` ago (a clean-up
  task deletes them).
- Run: one dispatcher claims queued jobs while fewer than ``jobs.concurrency`` run, each under
  a lease in the store that this process renews every third of it while the job runs; every
  third of a lease it also puts back in the queue running jobs whose lease has passed (their
  runner died), never a live peer's. A job runs through the same inference path as live
  requests with exactly the rights its key has now; if that key is no longer configured (or,
  with keys configured, the job was stored by a version that did not record its key), the
  job is not run and a 401 is its result; a key now given to another tenant gives 403. An
  answer of 429, 503 or 504 is transient: the job goes back in the queue after an
  exponential backoff (at least the answer's Retry-After), until it has run
  ``jobs.max_attempts`` times; then that answer is its result.
- Callbacks: completing a job makes its callback due in the store; ``DeliveryQueue``
  (``callback_delivery.py``) delivers due callbacks, after a restart too.
- Store I/O runs in a small thread pool, never on the event loop. A store outage answers 503
  (``StoreUnavailable``), never 500; the runner waits it out and loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from starlette.types import Receive

from sokuji.config import ServerConfig
from sokuji.core.backoff import Backoff
from sokuji.core.job import Job, JobStatus, JobStoreProtocol, QuotaHit
from sokuji.core.poll_loop import PollLoop
from sokuji.core.retry_after import parse_retry_after
from sokuji.errors import (
    Forbidden,
    NotFound,
    Overloaded,
    SokujiError,
    StoreUnavailable,
    Unauthorized,
)
from sokuji.server import scheduling
from sokuji.server.auth import OPEN, Authenticator, Tenant, key_id
from sokuji.server.callback_delivery import (
    CallbackSender,
    DeliveryQueue,
    default_secret,
    tenant_secret,
)
from sokuji.server.callbacks import CALLBACK_HEADER, Allowlist, CallbackPolicy, Resolver, parse
from sokuji.server.http import BodyTimeout, Headers, Reply, json_reply, read_body

log = logging.getLogger(__name__)
JOBS_PREFIX = "/v2/jobs/"
KEPT_HEADERS = ("content-type", "inference-header-content-length", "cache-control")
"""Request headers a job keeps (besides its settled priority)."""
TRANSIENT = frozenset({429, 503, 504})
RETRY_BACKOFF = Backoff(base_s=0.5, cap_s=60.0, jitter=0.25)
"""The wait before a job whose answer was transient runs again: 0.5 s doubling with each
run up to 60 s, and up to 25% more so that jobs refused together do not come back together
(``backoff_s``)."""
QUOTA_RETRY_AFTER_S = 1
BYTES_RETRY_AFTER_S = 60
IDLE_POLL_S = 1.0
"""An idle runner looks for work this often: due retries, and jobs other replicas queued."""
PURGE_EVERY_S = 60.0
STORE_THREADS = 4
STORE_BACKOFF = Backoff(base_s=0.1, cap_s=5.0)
"""The runner's waits while the store is down: 0.1 s doubling up to 5 s."""
DELIVERY_LEASE_MARGIN_S = 10.0
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
        self.config = config
        self.max_request_bytes = config.max_request_bytes
        self.body_timeout = BodyTimeout.of(config)
        self.limit_of: Callable[[str], int] | None = None
        """The body limit of a path's model (media models have their own), if known."""
        self.max_stored_bytes = j.max_stored_bytes_per_tenant
        self._keys = {key_id(k.key): k for k in config.api_keys}
        self._global_allow = Allowlist.of(j.callback_allow)
        self._allow = {kid: Allowlist.of(j.callback_allow, k.callback_allow)
                       for kid, k in self._keys.items()}
        self.resolver = Resolver(timeout_s=j.callback_timeout_s)
        self.callbacks = CallbackSender(CallbackPolicy(j.callback_allow, self.resolver),
                                        j.callback_timeout_s)
        self.default_secret = ""
        """Set by ``start`` (``callback_delivery.default_secret``)."""
        self.deliveries = DeliveryQueue(store, self._io, self._patiently, self.callbacks,
                                        self._credentials,
                                        2 * j.callback_timeout_s + DELIVERY_LEASE_MARGIN_S)
        self._pool = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="sokuji-jobs")
        self._respond: Respond | None = None
        self._check: CheckModel | None = None
        self._poll = PollLoop(IDLE_POLL_S)
        """The dispatcher's: woken by a submission, a due retry, a recovered lease."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._held: set[str] = set()
        """Jobs this process is running (their leases are renewed)."""

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (a store call) in the store's threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))

    async def _patiently(self, fn: Callable[..., T], *args: Any) -> T:
        """A store call for the runner: while the store is unavailable, wait and try again
        (work already accepted must not be dropped because Redis blinked)."""
        waits = STORE_BACKOFF.delays()
        while True:
            try:
                return await self._io(fn, *args)
            except StoreUnavailable:
                await asyncio.sleep(next(waits))

    # --- HTTP ------------------------------------------------------------------------------
    async def submit(self, path: str, headers: Headers, receive: Receive,
                     tenant: Tenant) -> Reply:
        """``POST`` with ``Prefer: respond-async`` by ``tenant`` (authenticated by the app)."""
        callback = headers.get(CALLBACK_HEADER)
        if callback is not None:
            parse(callback)  # its shape: a 400 before the body is read
        limit = self.limit_of(path) if self.limit_of is not None else self.max_request_bytes
        body = await read_body(receive, headers, limit, self.body_timeout)
        if self._check is not None:
            self._check(path, body, tenant)
        kept = {k: headers[k] for k in KEPT_HEADERS if k in headers}
        asked = {scheduling.PRIORITY_HEADER: headers.get(scheduling.PRIORITY_HEADER, "batch")}
        kept[scheduling.PRIORITY_HEADER] = scheduling.priority(
            asked, {}, tenant.priority, tenant.max_priority).name.lower()
        key = self._keys.get(tenant.key_id)
        limit = (key.max_pending_jobs if key is not None and key.max_pending_jobs
                 else self.jobs.max_pending_per_tenant)
        if callback is not None:  # the quotas first: a lookup costs a thread
            usage = await self._io(self.store.usage, tenant.name)
            if usage.pending >= limit:
                raise self._refusal(tenant.name, limit, QuotaHit.PENDING)
            if usage.stored_bytes + len(body) > self.max_stored_bytes:
                raise self._refusal(tenant.name, limit, QuotaHit.BYTES)
            await self.callbacks.check(callback, tenant.name,
                                       self._allow.get(tenant.key_id, self._global_allow))
        job_id = await self._io(partial(self.store.submit, key_id=tenant.key_id,
                                        max_bytes=self.max_stored_bytes),
                                tenant.name, path, kept, body, callback, limit)
        if isinstance(job_id, QuotaHit):
            raise self._refusal(tenant.name, limit, job_id)
        self._poll.wake()
        location = f"{JOBS_PREFIX}{job_id}"
        return json_reply({"id": job_id, "status": JobStatus.QUEUED.value,
                           "location": location}, 202,
                          {"location": location, "preference-applied": "respond-async"})

    def _refusal(self, tenant: str, limit: int, hit: QuotaHit) -> Overloaded:
        if hit is QuotaHit.PENDING:
            return Overloaded(f"tenant '{tenant}' already has {limit} unfinished jobs (queued "
                              "or running): submit more when some have finished",
                              retry_after_s=QUOTA_RETRY_AFTER_S)
        return Overloaded(f"tenant '{tenant}' would keep more than {self.max_stored_bytes} "
                          "bytes in the job store (bodies of unfinished jobs, results of "
                          "finished ones until they expire): submit more when some have "
                          "finished or expired", retry_after_s=BYTES_RETRY_AFTER_S)

    async def status(self, path: str, tenant: Tenant) -> Reply:
        """``GET`` of a job or its result by ``tenant`` (authenticated by the app)."""
        rest = path[len(JOBS_PREFIX):].split("/")
        if not _JOB_ID.fullmatch(rest[0]) or rest[1:] not in ([], ["result"]):
            raise NotFound(f"no job at {path}")
        job = await self._io(self.store.get, rest[0])
        if job is None or (self.auth.enabled and not _owns(tenant, job)):
            raise NotFound(f"no job at {path}")
        doc = self._describe(job)
        if rest[1:] == ["result"]:
            if job.result_status is None or job.result_body is None:
                return json_reply(doc, 202)
            return Reply(job.result_status, job.result_body, job.result_headers or {})
        return json_reply(doc)

    def _describe(self, job: Job) -> dict[str, Any]:
        callback = None
        if job.callback_url:  # pending | delivered | failed | refused: never the remote's
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
        self.default_secret = default_secret(self.config)
        self._spawn(self._dispatch())
        self._spawn(self._keep_leases())
        self._spawn(self._housekeep())
        self._spawn(self.deliveries.run())

    async def stop(self) -> None:
        """Stop running jobs and callbacks; this process's running jobs go back to the queue
        at once (others run them, or this server after a restart), due callbacks stay due."""
        held = list(self._held)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if held:
            with contextlib.suppress(StoreUnavailable):  # then their leases free them
                await self._io(self.store.release, held)
        self.resolver.close()
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

        async def claim() -> bool:
            await slots.acquire()
            job = await self._patiently(self.store.claim)
            if job is None:
                slots.release()
                return False
            self._held.add(job.id)
            task = self._spawn(self._process(job))
            task.add_done_callback(lambda _: slots.release())
            return True

        await self._poll.run(claim)

    async def _keep_leases(self) -> None:
        """Every third of a lease: renew this process's, and requeue expired ones."""
        while True:
            await asyncio.sleep(self.store.lease_s / 3)
            with contextlib.suppress(StoreUnavailable):  # logged by the store; next round
                if self._held:
                    await self._io(self.store.renew, list(self._held))
                recovered = await self._io(self.store.recover)
                if recovered:
                    log.info("jobs: %d job(s) whose runner stopped renewing queued again",
                             recovered)
                    self._poll.wake()

    async def _process(self, job: Job) -> None:
        try:
            reply = await self._run(job)
            if reply is None:  # cannot happen: a job's request never disconnects
                return
            if reply.status in TRANSIENT and job.attempts < self.jobs.max_attempts:
                delay_s = backoff_s(job.attempts, reply.headers.get("retry-after"))
                if await self._patiently(self.store.retry, job.id, delay_s):
                    log.info("job %s: answer %d, run %d of %d again in %.1f s", job.id,
                             reply.status, job.attempts + 1, self.jobs.max_attempts, delay_s)
                    self._poll.wake_in(delay_s)
                return
            if not await self._patiently(self.store.complete, job.id, reply.status,
                                         reply.headers, reply.body):
                log.info("job %s: its lease passed and another run took it over; this "
                         "run's answer is dropped", job.id)
            elif job.callback_url:
                self.deliveries.wake()
        finally:
            self._held.discard(job.id)

    def _rights(self, job: Job) -> Tenant | SokujiError:
        """The tenant to run ``job`` as: its key's rights as configured now. A refusal (401,
        403), answered and stored as the synchronous call's would be, if the key is gone
        (never wider rights than the key had)."""
        if not self.auth.enabled:
            return OPEN  # an open server: anyone may do what the job does
        if job.key_id is None:
            status, why = 401, ("this job was stored by an older version of the server, which "
                                "did not record the API key that submitted it; it was not "
                                "run: submit it again")
        elif not job.key_id:
            status, why = 401, ("this job was submitted while the server needed no API key; "
                                "now that keys are configured it was not run")
        elif (tenant := self.auth.by_key_id(job.key_id)) is None:
            status, why = 401, ("the API key that submitted this job is no longer configured; "
                                "the job was not run")
        elif tenant.name != job.tenant:
            status, why = 403, ("the API key that submitted this job now belongs to another "
                                "tenant; the job was not run")
        else:
            return tenant
        log.warning("job %s (tenant %r): %s", job.id, job.tenant, why)
        return Unauthorized(why) if status == 401 else Forbidden(why)

    async def _run(self, job: Job) -> Reply | None:
        """The job through the inference path (``respond``), as its key (or, refused, with
        the refusal mapped there like any other error)."""
        assert self._respond is not None
        tenant = self._rights(job)
        headers = dict(job.headers)
        headers.setdefault(scheduling.PRIORITY_HEADER, "batch")  # jobs of older versions
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()  # nothing more will come
            sent = True
            return {"type": "http.request", "body": job.body, "more_body": False}

        return await self._respond("POST", job.path, headers, receive, time.perf_counter_ns(),
                                   tenant)

    def _credentials(self, job: Job) -> tuple[str, Allowlist]:
        """The signing key and allowlist of ``job``'s callback: its key's, while that key is
        configured for the job's tenant; else the tenant's derived key and the global list."""
        key = self._keys.get(job.key_id or "")
        if key is not None and key.tenant == job.tenant:
            secret = key.callback_secret or tenant_secret(self.default_secret, job.tenant)
            return secret, self._allow[job.key_id or ""]
        return tenant_secret(self.default_secret, job.tenant), self._global_allow

    async def _housekeep(self) -> None:
        """Delete finished jobs past their TTL, every ``PURGE_EVERY_S`` (or half the TTL)."""
        every_s = min(PURGE_EVERY_S, max(1.0, self.store.result_ttl_s / 2))
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(StoreUnavailable):  # logged by the store; next round
                purged = await self._io(self.store.purge)
                if purged:
                    log.info("jobs: %d finished job(s) past jobs.result_ttl_s deleted", purged)


def _owns(tenant: Tenant, job: Job) -> bool:
    """Whether a keyed ``tenant`` may read ``job``: one its tenant stored with a key. A job an
    open server stored (no key: ``key_id`` empty) is nobody's once keys are configured, even
    for a tenant named like the open server's one (``anonymous``)."""
    return job.tenant == tenant.name and job.key_id != ""


def backoff_s(attempts: int, retry_after: str | None) -> float:
    """The wait before run ``attempts + 1`` (``RETRY_BACKOFF``): at least the answer's
    ``Retry-After``, if it has one."""
    return RETRY_BACKOFF.delay_s(attempts, parse_retry_after(retry_after) or 0)
