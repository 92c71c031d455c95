"""Delivering job callbacks: signed, pinned to the vetted address, no redirects, short outcomes.

Each attempt vets the URL again (``callbacks.CallbackPolicy``: DNS can change between
attempts), then POSTs with aiohttp through a resolver that answers only the vetted address,
so the connection cannot go anywhere else; the Host header and the TLS server name stay the
URL's. A 2xx is ``delivered``; connection errors, timeouts, 408, 429 and 5xx are tried again
after ``ATTEMPT_DELAYS_S``; anything else (3xx included: redirects are never followed) is
``failed``. The remote's status and error text are logged, never stored for the client.

Signature (Stripe / Standard Webhooks style): ``X-Sokuji-Timestamp: <unix seconds>`` and
``X-Sokuji-Signature: v1=<hex HMAC-SHA256(key, "<timestamp>." + body)>``, the key being the
UTF-8 bytes of the tenant's ``callback_secret``, else ``jobs.callback_secret``, else the
random secret kept in ``<cache_dir>/callback_secret``. ``verify`` is the receiver's side.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import importlib.util
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sokuji.server.callbacks import CallbackPolicy, CallbackRefused, Target

log = logging.getLogger(__name__)
DELIVERED, FAILED = "delivered", "failed"
ATTEMPT_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
"""Waits before the second and later attempts (connection errors, timeouts, 408, 429, 5xx)."""
MAX_DELIVERIES = 64
"""Callbacks in flight at once; more wait their turn."""
SIGNATURE_TOLERANCE_S = 300


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
    """Checks callback URLs at submit and delivers signed results (module docstring)."""

    def __init__(self, policy: CallbackPolicy, default_secret: str,
                 tenant_secrets: Mapping[str, str], timeout_s: float) -> None:
        self.policy = policy
        self.default_secret = default_secret
        self.tenant_secrets = dict(tenant_secrets)
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(MAX_DELIVERIES)
        self.available = importlib.util.find_spec("aiohttp") is not None

    async def check(self, url: str) -> None:
        """At submit: ``CallbackRefused`` (400) unless the URL would be delivered to now."""
        if not self.available:
            raise CallbackRefused("this server cannot deliver callbacks (its Python "
                                  "environment lacks aiohttp); poll the job instead")
        _same_host(await self.policy.vet(url))

    def headers(self, tenant: str, job_id: str, body: bytes,
                now: float | None = None) -> dict[str, str]:
        timestamp = int(time.time() if now is None else now)
        secret = self.tenant_secrets.get(tenant) or self.default_secret
        return {"content-type": "application/json", "user-agent": "sokuji-callback/1",
                "x-sokuji-job-id": job_id, "x-sokuji-timestamp": str(timestamp),
                "x-sokuji-signature": sign(secret, timestamp, body)}

    async def deliver(self, tenant: str, job_id: str, url: str, body: bytes) -> str:
        """POST ``body`` to ``url`` until it is taken (2xx) or refused; the job's callback
        status: ``delivered``, ``failed`` or ``refused: <reason>``. Details are logged only."""
        async with self._slots:
            for attempt, delay in enumerate((0.0, *ATTEMPT_DELAYS_S), start=1):
                await asyncio.sleep(delay)
                try:
                    target = _same_host(await self.policy.vet(url))
                except CallbackRefused as exc:
                    log.warning("job %s: callback refused: %s", job_id, exc.reason)
                    return f"refused: {exc.reason}"
                try:
                    status = await self._post(target, self.headers(tenant, job_id, body), body)
                except DeliveryFailed as exc:
                    log.info("job %s: callback to %s attempt %d: %s", job_id, target.host,
                             attempt, exc)
                    continue
                log.info("job %s: callback to %s attempt %d: HTTP %d", job_id, target.host,
                         attempt, status)
                if 200 <= status < 300:
                    return DELIVERED
                if status not in (408, 429) and status < 500:
                    return FAILED  # 3xx (redirects are not followed) and other 4xx: final
            return FAILED

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


def _same_host(target: Target) -> Target:
    """``target`` if the HTTP client reads the same host from the URL as the vetting did (a
    URL two parsers read differently is how filters get bypassed)."""
    import yarl

    try:
        host = (yarl.URL(target.url).host or "").lower().rstrip(".")
    except ValueError:
        host = ""
    if host.strip("[]") != target.host.strip("[]"):
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
