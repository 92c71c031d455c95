"""Asynchronous inference over HTTP: ``Prefer: respond-async`` gives 202 and a job to poll.

- Submit: any inference request (V2 infer or ``/v1/embeddings``) with
  ``Prefer: respond-async`` is authorised, checked, written to the job store, and answered
  ``202 Accepted`` with ``Location: /v2/jobs/{id}``. Optional ``X-Sokuji-Callback-Url``
  receives the result by POST, retried with exponential backoff.
- Poll: ``GET /v2/jobs/{id}`` gives the status; ``GET /v2/jobs/{id}/result`` gives the stored
  response exactly as the synchronous call would have (202 with the status until then).
  Another tenant's job is a 404.
- Run: worker tasks claim queued jobs and send them through the same inference path as live
  requests, at ``batch`` priority unless the request said otherwise, so interactive traffic
  goes first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Receive

from sokuji.core.jobs import Job, JobStatus, JobStore, RedisJobStore
from sokuji.errors import InvalidInput, MethodNotAllowed, NotFound
from sokuji.server.auth import Authenticator, Tenant
from sokuji.server.http import Headers, Reply, json_reply, read_body

log = logging.getLogger(__name__)
JOBS_PREFIX = "/v2/jobs/"
CALLBACK_HEADER = "x-sokuji-callback-url"
KEPT_HEADERS = ("content-type", "inference-header-content-length", "x-sokuji-priority",
                "cache-control")
CALLBACK_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)

Respond = Callable[..., Awaitable[Reply | None]]
CheckModel = Callable[[str, bytes, Tenant], None]


class JobService:
    def __init__(self, store: JobStore | RedisJobStore, auth: Authenticator,
                 max_request_bytes: int,
                 concurrency: int) -> None:
        self.store = store
        self.auth = auth
        self.max_request_bytes = max_request_bytes
        self.concurrency = concurrency
        self._respond: Respond | None = None
        self._check: CheckModel | None = None
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- HTTP ------------------------------------------------------------------------------
    async def submit(self, method: str, path: str, headers: Headers,
                     receive: Receive) -> Reply:
        if method != "POST":
            raise MethodNotAllowed(f"{method} is not allowed on {path}; use POST")
        tenant = self.auth.authenticate(headers)
        callback = headers.get(CALLBACK_HEADER)
        if callback is not None and not callback.startswith(("http://", "https://")):
            raise InvalidInput(f"{CALLBACK_HEADER} must be an http(s) URL", param=CALLBACK_HEADER)
        body = await read_body(receive, headers, self.max_request_bytes)
        if self._check is not None:
            self._check(path, body, tenant)
        kept = {k: headers[k] for k in KEPT_HEADERS if k in headers}
        job_id = self.store.submit(tenant.name, path, kept, body, callback)
        self._wake.set()
        location = f"{JOBS_PREFIX}{job_id}"
        return json_reply({"id": job_id, "status": JobStatus.QUEUED.value,
                           "location": location}, 202,
                          {"location": location, "preference-applied": "respond-async"})

    async def status(self, method: str, path: str, headers: Headers) -> Reply:
        if method != "GET":
            raise MethodNotAllowed(f"{method} is not allowed on {path}; use GET")
        tenant = self.auth.authenticate(headers)
        rest = path[len(JOBS_PREFIX):].split("/")
        job = self.store.get(rest[0]) if rest[0] else None
        if job is None or (self.auth.enabled and job.tenant != tenant.name) \
                or rest[1:] not in ([], ["result"]):
            raise NotFound(f"no job at {path}")
        doc = self._describe(job)
        if rest[1:] == ["result"]:
            if job.result_status is None or job.result_body is None:
                return json_reply(doc, 202)
            return Reply(job.result_status, job.result_body, job.result_headers or {})
        return json_reply(doc)

    @staticmethod
    def _describe(job: Job) -> dict[str, Any]:
        return {"id": job.id, "status": job.status.value, "attempts": job.attempts,
                "created_at": job.created_at, "finished_at": job.finished_at,
                "result": f"{JOBS_PREFIX}{job.id}/result", "callback": job.callback_status}

    # --- running ---------------------------------------------------------------------------
    def start(self, respond: Respond, check: CheckModel) -> None:
        """Run jobs through ``respond`` (the inference path); ``check`` vets submissions."""
        self._respond = respond
        self._check = check
        recovered = self.store.recover()
        if recovered:
            log.info("jobs: %d interrupted job(s) queued again", recovered)
        for _ in range(self.concurrency):
            task = asyncio.get_running_loop().create_task(self._work())
            self._tasks.add(task)
        self._wake.set()

    async def stop(self) -> None:
        """Stop running jobs; unfinished ones stay in the store and run after a restart."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self.store.close()

    async def _work(self) -> None:
        while True:
            job = self.store.claim()
            if job is None:
                self._wake.clear()
                job = self.store.claim()
                if job is None:
                    await self._wake.wait()
                    continue
            self._wake.set()  # there may be more: let another worker look
            reply = await self._run(job)
            if reply is None:
                continue
            if self.store.complete(job.id, reply.status, reply.headers, reply.body) \
                    and job.callback_url:
                task = asyncio.get_running_loop().create_task(self._deliver(job.id,
                                                                            job.callback_url,
                                                                            reply))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

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

    async def _deliver(self, job_id: str, url: str, reply: Reply) -> None:
        body = json.dumps({"id": job_id, "status": reply.status,
                           "content_type": reply.headers.get("content-type", ""),
                           "body": reply.body.decode("utf-8", "replace")}).encode()
        for attempt, delay in enumerate((0.0, *CALLBACK_DELAYS_S), start=1):
            await asyncio.sleep(delay)
            try:
                status = await asyncio.to_thread(_post, url, body)
            except OSError as exc:
                log.info("job %s: callback attempt %d failed: %s", job_id, attempt, exc)
                continue
            if status < 500:
                self.store.set_callback_status(job_id, f"delivered ({status})")
                return
        self.store.set_callback_status(job_id, f"failed after {attempt} attempts")


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
