"""Delivering job callbacks: from the store, signed, pinned to the vetted address, no
redirects, short outcomes.

- **Durable** (``DeliveryQueue``): a finished job's callback is due in the job store, not in
  memory. The queue takes due callbacks from the store (at most ``MAX_DELIVERIES`` attempts
  at once, at most ``MAX_DELIVERIES_PER_TENANT`` of one tenant's), reads the result from the
  store when an attempt starts, and records the outcome, or when the next attempt is due:
  nothing waits in memory between attempts. An attempt holds a lease in the store; if the
  server dies during it, the callback is due again when the lease passes, after a restart
  too. Delivery is therefore at least once: receivers deduplicate on ``X-Sokuji-Job-Id``.
- **One attempt** (``CallbackSender.attempt``): vet the URL again (``callbacks.py``: DNS can
  change), then POST with aiohttp through a resolver that answers only the vetted address, so
  the connection cannot go anywhere else; the Host header and the TLS server name stay the
  URL's. A 2xx is ``delivered``; no answer, a timeout, 408, 429, 5xx, or a host that does not
  resolve are tried again after a backoff (``RETRY``), up to ``MAX_ATTEMPTS`` attempts; a
  3xx (redirects are never followed) or another 4xx is ``failed``; an address the policy
  refuses is ``refused``. The remote's status and error text are logged, never stored for
  the client.
- **Signature** (Stripe / Standard Webhooks style): ``X-Sokuji-Timestamp: <unix seconds>`` and
  ``X-Sokuji-Signature: v1=<hex HMAC-SHA256(key, "<timestamp>." + body)>``, with
  ``X-Sokuji-Tenant`` and ``X-Sokuji-Job-Id``. The key is the UTF-8 bytes of the submitting
  API key's ``callback_secret``, else of the tenant's derived key ``tenant_secret(default,
  tenant)`` (hex HMAC-SHA256 of ``"sokuji-callback:" + tenant`` under the default secret:
  ``jobs.callback_secret``, else the random one kept in ``<cache_dir>/callback_secret``), so
  no two tenants share a key and one cannot aim signed callbacks at another's receiver.
  ``sokuji callback-secret TENANT`` prints a tenant's derived key; ``verify`` is the
  receiver's side.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import enum
import hashlib
import hmac
import importlib.util
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from sokuji.config import ServerConfig
from sokuji.core.backoff import Backoff
from sokuji.core.job import CALLBACK_PENDING, Job, JobStoreProtocol
from sokuji.core.poll_loop import PollLoop
from sokuji.errors import ConfigError, Overloaded, StoreUnavailable
from sokuji.server.callbacks import Allowlist, CallbackPolicy, CallbackRefused, Target

log = logging.getLogger(__name__)
RETRY = Backoff(base_s=0.5, cap_s=8.0)
"""Waits before the second and later attempts (transient outcomes): 0.5 s doubling to 8 s."""
MAX_ATTEMPTS = 6
MAX_DELIVERIES = 64
"""Attempts in flight at once, all tenants together."""
MAX_DELIVERIES_PER_TENANT = 4
IDLE_POLL_S = 1.0
"""The queue looks for due callbacks this often when nothing wakes it (other replicas')."""
SIGNATURE_TOLERANCE_S = 300
DERIVATION_LABEL = b"sokuji-callback:"


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    FAILED = "failed"
    REFUSED = "refused"
    RETRY = "retry"
    """Transient: worth another attempt, if any is left (else ``failed``)."""


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """``v1=<hex>``: HMAC-SHA256 keyed by the secret's UTF-8 bytes over
    ``"<timestamp>." + body``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"v1={mac.hexdigest()}"


def verify(secret: str, timestamp: str, signature: str, body: bytes,
           tolerance_s: float = SIGNATURE_TOLERANCE_S, now: float | None = None) -> bool:
    """What a receiver does: the timestamp is recent and one ``v1=`` signature matches."""
    try:
        ts = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    expected = sign(secret, ts, body)
    return any(hmac.compare_digest(expected, s.strip()) for s in signature.split(","))


def tenant_secret(default_secret: str, tenant: str) -> str:
    """The signing key of ``tenant``'s callbacks when its key has no ``callback_secret``:
    hex HMAC-SHA256 of ``"sokuji-callback:" + tenant`` keyed by the default secret."""
    return hmac.new(default_secret.encode(), DERIVATION_LABEL + tenant.encode(),
                    hashlib.sha256).hexdigest()


def load_or_create_secret(path: Path) -> str:
    """The secret kept in ``path`` (mode 0600), made once from 32 random bytes. Two processes
    starting together agree: the file appears whole or not at all (link, not write)."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def default_secret(config: ServerConfig) -> str:
    """``jobs.callback_secret``, else the one kept in ``<cache_dir>/callback_secret`` (made
    now if there is none); ``ConfigError`` if it cannot be kept there."""
    if config.jobs.callback_secret:
        return config.jobs.callback_secret
    try:
        return load_or_create_secret(Path(config.cache_dir) / "callback_secret")
    except OSError as exc:
        raise ConfigError.for_key("cache_dir", config.cache_dir, "cannot keep the callback "
                                  f"secret there ({exc.strerror}); set jobs.callback_secret"
                                  ) from None


def payload(job_id: str, status: int, headers: Mapping[str, str], body: bytes) -> bytes:
    """The callback's JSON body: the job's reply, as text, or base64 when it is binary."""
    import orjson

    doc: dict[str, Any] = {"id": job_id, "status": status,
                           "content_type": headers.get("content-type", "")}
    try:
        doc["body"] = body.decode("utf-8")
    except UnicodeDecodeError:
        doc["body_base64"] = base64.b64encode(body).decode()
    return orjson.dumps(doc)


class CallbackSender:
    """Checks callback URLs at submit and makes single delivery attempts."""

    def __init__(self, policy: CallbackPolicy, timeout_s: float) -> None:
        self.policy = policy
        self.timeout_s = timeout_s
        self.available = importlib.util.find_spec("aiohttp") is not None

    async def check(self, url: str, tenant: str, allow: Allowlist) -> None:
        """At submit: ``CallbackRefused`` (400) unless the URL would be delivered to now;
        ``Overloaded`` (429) if ``tenant``'s host lookups are at their bound."""
        if not self.available:
            raise CallbackRefused("this server cannot deliver callbacks (its Python "
                                  "environment lacks aiohttp); poll the job instead")
        _same_host(await self.policy.vet(url, tenant, allow))

    @staticmethod
    def headers(secret: str, tenant: str, job_id: str, body: bytes,
                now: float | None = None) -> dict[str, str]:
        timestamp = int(time.time() if now is None else now)
        return {"content-type": "application/json", "user-agent": "sokuji-callback/1",
                "x-sokuji-job-id": job_id, "x-sokuji-tenant": tenant,
                "x-sokuji-timestamp": str(timestamp),
                "x-sokuji-signature": sign(secret, timestamp, body)}

    async def attempt(self, job: Job, body: bytes, secret: str, allow: Allowlist) -> Outcome:
        """One POST of ``body`` to the job's callback URL; details are logged only."""
        assert job.callback_url is not None
        try:
            target = _same_host(await self.policy.vet(job.callback_url, job.tenant, allow))
        except CallbackRefused as exc:
            log.info("job %s: callback attempt %d refused: %s", job.id, job.callback_attempts,
                     exc.reason)
            return Outcome.RETRY if exc.lookup_failed else Outcome.REFUSED
        except Overloaded:
            return Outcome.RETRY
        try:
            status = await self._post(target, self.headers(secret, job.tenant, job.id, body),
                                      body)
        except DeliveryFailed as exc:
            log.info("job %s: callback to %s attempt %d: %s", job.id, target.host,
                     job.callback_attempts, exc)
            return Outcome.RETRY
        log.info("job %s: callback to %s attempt %d: HTTP %d", job.id, target.host,
                 job.callback_attempts, status)
        if 200 <= status < 300:
            return Outcome.DELIVERED
        if status in (408, 429) or status >= 500:
            return Outcome.RETRY
        return Outcome.FAILED  # 3xx (redirects are not followed) and other 4xx: final

    async def _post(self, target: Target, headers: dict[str, str], body: bytes) -> int:
        """One POST to ``target.address`` (pinned), the status of the answer (its body is not
        read); ``DeliveryFailed`` if no answer came."""
        import aiohttp

        assert target.address is not None
        connector = aiohttp.TCPConnector(resolver=_pinned_resolver(target.address),
                                         use_dns_cache=False, force_close=True, limit=1)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                             trust_env=False) as session, \
                    session.post(target.url, data=body, headers=headers,
                                 allow_redirects=False) as reply:
                return reply.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise DeliveryFailed(type(exc).__name__) from exc


class DeliveryFailed(Exception):
    """An attempt got no HTTP answer (connection refused or reset, timeout, bad reply)."""


Io = Callable[..., Awaitable[Any]]
Credentials = Callable[[Job], tuple[str, Allowlist]]
"""A job's signing key and allowlist (those of the key that submitted it)."""


class DeliveryQueue:
    """Delivers the callbacks the store says are due (module docstring). ``io`` runs a store
    call off the loop; ``patiently`` does too, waiting out a store outage."""

    def __init__(self, store: JobStoreProtocol, io: Io, patiently: Io, sender: CallbackSender,
                 credentials: Credentials, lease_s: float) -> None:
        self.store = store
        self._io = io
        self._patiently = patiently
        self.sender = sender
        self.credentials = credentials
        self.lease_s = lease_s
        """An attempt's lease in the store: longer than an attempt can take."""
        self._poll = PollLoop(IDLE_POLL_S)
        self._in_flight: dict[str, str] = {}
        """Job id -> tenant, of the attempts running now."""
        self._tasks: set[asyncio.Task[None]] = set()

    def wake(self) -> None:
        """Look for due callbacks now (a job finished, an attempt ended)."""
        self._poll.wake()

    async def run(self) -> None:
        """Until cancelled; then the attempts in flight are cancelled too (their callbacks are
        due again when their leases pass)."""

        async def start_due() -> bool:
            with contextlib.suppress(StoreUnavailable):  # logged by the store
                await self._start_due()
            return False  # the next look: when woken, or the idle poll

        try:
            await self._poll.run(start_due)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _start_due(self) -> None:
        if len(self._in_flight) >= MAX_DELIVERIES:
            return
        due = await self._io(self.store.due_callbacks, MAX_DELIVERIES_PER_TENANT)
        busy = collections.Counter(self._in_flight.values())
        for job_id, tenant in due:
            if len(self._in_flight) >= MAX_DELIVERIES:
                return
            if job_id in self._in_flight or busy[tenant] >= MAX_DELIVERIES_PER_TENANT:
                continue
            job = await self._io(self.store.take_callback, job_id, self.lease_s)
            if job is None or job.callback_url is None or job.result_status is None:
                continue  # another replica took it, or it expired
            busy[tenant] += 1
            self._in_flight[job_id] = tenant
            task = asyncio.get_running_loop().create_task(self._attempt(job))
            self._tasks.add(task)
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("callbacks: an attempt failed (it is due again when its lease passes)",
                      exc_info=task.exception())

    async def _attempt(self, job: Job) -> None:
        try:
            secret, allow = self.credentials(job)
            body = payload(job.id, job.result_status or 0, job.result_headers or {},
                           job.result_body or b"")
            outcome = await self.sender.attempt(job, body, secret, allow)
            if outcome is Outcome.RETRY and job.callback_attempts < MAX_ATTEMPTS:
                delay_s = RETRY.delay_s(job.callback_attempts)
                await self._patiently(self.store.set_callback_status, job.id,
                                      CALLBACK_PENDING, delay_s)
                self._poll.wake_in(delay_s)
                return
            final = Outcome.FAILED if outcome is Outcome.RETRY else outcome
            await self._patiently(self.store.set_callback_status, job.id, final.value)
        finally:
            self._in_flight.pop(job.id, None)
            self.wake()


def _same_host(target: Target) -> Target:
    """``target`` if the HTTP client reads the same host from the URL as the vetting did (a
    URL two parsers read differently is how filters get bypassed). IP literals compare as
    addresses (``[2606:4700:0:0:0:0:0:1111]`` is ``[2606:4700::1111]``)."""
    import ipaddress

    import yarl

    def canonical(host: str) -> str:
        host = host.strip("[]").lower().rstrip(".")
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            return host

    try:
        host = yarl.URL(target.url).host or ""
    except ValueError:
        host = ""
    if not host or canonical(host) != canonical(target.host):
        raise CallbackRefused("the URL's host is ambiguous")
    return target


def _pinned_resolver(address: str) -> Any:
    """An aiohttp resolver that answers every name with ``address`` (already vetted)."""
    from aiohttp.abc import AbstractResolver

    address_family = socket.AF_INET6 if ":" in address else socket.AF_INET

    class Pinned(AbstractResolver):
        async def resolve(self, host: str, port: int = 0,
                          family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
            return [{"hostname": host, "host": address, "port": port,
                     "family": address_family, "proto": 0, "flags": socket.AI_NUMERICHOST}]

        async def close(self) -> None:
            pass

    return Pinned()
