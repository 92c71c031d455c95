"""The HTTP side of an upstream model (``upstream.py``): one pooled aiohttp session per
upstream, the headers each attempt carries, the one safe retry, bounded bodies.

- **Pool**: ``TCPConnector(limit=max_connections, keepalive_timeout=keepalive_s)``; idle
  connections close before the upstream's own idle timeout (uvicorn, so Sokuji: 5 s).
  Redirects are never followed and no proxy from the environment is used: the upstream's
  address comes from the config only.
- **Safe retry**: once, and only when a *reused* pooled connection was closed by the server
  before any response byte (the race between our reuse and its idle close): nothing was
  processed, so sending again is safe. Any other failure is the caller's to handle (the
  router tries a fallback).
- **Headers**: the request's remaining budget (``X-Sokuji-Timeout-Ms``: a Sokuji upstream
  then refuses work it cannot start in time), its priority, ``traceparent`` (traced: our
  span's, ``tracing.Hop``; else the client's if valid), a request id, and the upstream's
  own bearer key (per tenant, else the model's): never the client's.
- **Shared credentials** (``reveals``): what an answer tells of the upstream's own state
  (its cache hits: ``cached_tokens``; its timings: ``Server-Timing``) reflects every request
  sent with the same credential. It reaches a tenant only when that tenant's credential on
  the upstream is its own (a key no other configured tenant is sent with); otherwise
  it is withheld, so one tenant cannot probe what another sent (the token-by-token oracle
  of a shared prompt cache). With no keys configured there is one caller and nothing is
  withheld.
- **Errors**: what the upstream answered (or failed to) as typed errors:
  ``upstream_errors.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any

import aiohttp
import orjson

from sokuji.core.model import RequestContext, Trace
from sokuji.core.trace import NO_HOP, Hop
from sokuji.observability.tracing import valid_traceparent
from sokuji.routing.config import UpstreamOptions
from sokuji.routing.upstream_errors import (
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnavailable,
    status_error,
)

ERROR_READ_BYTES = 16 * 1024
OnAttempt = Callable[[str, int | str, float], None]
"""(upstream model's served name, HTTP status or a word: connect_error, disconnected,
timeout, too_large, stream_error, cancelled; seconds): once per HTTP attempt."""


# -- the client -----------------------------------------------------------------------------
class Attempt:
    """One HTTP attempt: its start, whether its connection was reused, and its one report."""

    __slots__ = ("done", "hop", "reused", "t0")

    def __init__(self, hop: Hop = NO_HOP) -> None:
        self.t0 = time.perf_counter()
        self.reused = False
        self.done = False
        self.hop = hop  # a traced request's span for the call (``tracing.Hop``)


async def _on_reuse(session: Any, ctx: Any, params: Any) -> None:
    trace = ctx.trace_request_ctx
    if isinstance(trace, dict) and "attempt" in trace:
        trace["attempt"].reused = True


class UpstreamClient:
    """The session and the attempts of one upstream model."""

    def __init__(self, name: str, options: UpstreamOptions) -> None:
        self.name = name
        self.options = options
        self.base = options.url.rstrip("/")
        self.who = f"upstream '{options.upstream_model}' of model '{name}'"
        self.keys: dict[str, str] = {}
        """tenant -> bearer key (read from the environment at load)."""
        self.default_key = ""
        self.own_credential: frozenset[str] | None = None
        """The tenants whose credential on the upstream no other tenant shares (``share``);
        None: no keys are configured here, one caller."""
        self.session: aiohttp.ClientSession | None = None
        self.on_attempt: OnAttempt | None = None

    def start(self) -> None:
        """Create the session (from the loop that will use it)."""
        opts = self.options
        connector = aiohttp.TCPConnector(
            limit=opts.max_connections, limit_per_host=opts.max_connections,
            keepalive_timeout=opts.keepalive_s, enable_cleanup_closed=True, ttl_dns_cache=10)
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_on_reuse)
        # total: none (each attempt has its own asyncio.timeout); sock_read: a stream's gaps
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=opts.connect_timeout_ms / 1e3,
                                        sock_read=opts.timeout_ms / 1e3)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, trace_configs=[trace], trust_env=False,
            headers={"user-agent": "sokuji-upstream"}, raise_for_status=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def budget_s(self, ctx: RequestContext) -> float:
        """Seconds this attempt may take: ``timeout_ms`` within what is left of the
        deadline; an ``UpstreamTimeout`` if nothing is left (the upstream is not called)."""
        budget = self.options.timeout_ms / 1e3
        if ctx.deadline_ns is not None:
            left = (ctx.deadline_ns - time.perf_counter_ns()) / 1e9
            if left <= 0:
                raise UpstreamTimeout(f"model '{self.name}': the request's deadline passed "
                                      "before the upstream was called", before_response=True,
                                      target_fault=False)
            budget = min(budget, left)
        return budget

    def headers(self, ctx: RequestContext, budget_s: float) -> dict[str, str]:
        """The upstream call's headers. Only the server chooses their names; of what a
        client sent, only its request id (when it can be a header value) and the deadline
        and priority the server settled travel."""
        out = {"content-type": "application/json",
               "x-sokuji-timeout-ms": f"{max(budget_s * 1e3, 0.001):.3f}",
               "x-sokuji-priority": ctx.priority.name.lower(),
               "x-request-id": header_safe_id(ctx.request_id)}
        if valid_traceparent(ctx.traceparent):  # (traced: ``post`` puts our span's)
            out["traceparent"] = ctx.traceparent
        key = self.key_of(ctx.tenant)
        if key:
            out["authorization"] = f"Bearer {key}"
        return out

    def key_of(self, tenant: str) -> str:
        return self.keys.get(tenant, self.default_key)

    def share(self, tenants: Collection[str]) -> list[str]:
        """Decide, once (at load, with the keys read), whose answers may carry the
        upstream's shared state: ``tenants`` are every tenant configured on this server
        (empty: no keys, one caller). Returns the tenants that share a credential, sorted."""
        if not tenants:
            self.own_credential = None
            return []
        users = Counter(self.key_of(t) for t in tenants)
        # no key: the upstream takes anyone's requests as one caller's
        self.own_credential = frozenset(t for t in tenants
                                        if self.key_of(t) and users[self.key_of(t)] == 1)
        return sorted(set(tenants) - self.own_credential)

    def reveals(self, tenant: str) -> bool:
        """Whether what the upstream's own state shows (cache hits, its timings) may reach
        ``tenant``: its credential there is its own, or there is only one caller."""
        return self.own_credential is None or tenant in self.own_credential

    def report(self, attempt: Attempt, code: int | str) -> None:
        if attempt.done:
            return
        attempt.done = True
        attempt.hop.end(code)
        if self.on_attempt is not None:
            self.on_attempt(self.name, code, time.perf_counter() - attempt.t0)

    async def post(self, path: str, body: bytes, headers: dict[str, str],
                   tried: list[Attempt], trace: Trace | None = None) -> aiohttp.ClientResponse:
        """POST ``body``; the response once its status line and headers came, if 2xx (its
        body not read yet); otherwise the mapped error. Retried once when a reused
        connection was closed before any response byte. Each attempt is appended to
        ``tried``; one cut short by a timeout or a cancellation is the caller's to report."""
        if self.session is None:
            raise UpstreamUnavailable(f"model '{self.name}' is not started",
                                      before_response=True)
        url = self.base + path
        hop = NO_HOP if trace is None else trace.hop(self.options.upstream_model, url, headers)
        for retry in (False, True):
            attempt = Attempt(hop)
            tried.append(attempt)
            try:
                resp = await self.session.post(url, data=body, headers=headers,
                                               allow_redirects=False,
                                               trace_request_ctx={"attempt": attempt})
            except aiohttp.ServerTimeoutError as exc:  # connect, or no headers in sock_read
                self.report(attempt, "timeout")
                if isinstance(exc, aiohttp.ConnectionTimeoutError):
                    raise UpstreamUnavailable(f"{self.who}: cannot be reached (connect "
                                              "timeout)", before_response=True) from None
                raise UpstreamTimeout(f"{self.who}: no answer within timeout_ms",
                                      before_response=True) from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                closed = attempt.reused and not retry and not isinstance(
                    exc, aiohttp.ClientConnectorError)
                self.report(attempt, "disconnected" if closed else "connect_error")
                if closed:
                    continue  # the server closed an idle connection we reused: safe
                raise UpstreamUnavailable(f"{self.who}: cannot be reached "
                                          f"({type(exc).__name__})",
                                          before_response=True) from None
            except aiohttp.ClientError as exc:  # a malformed answer
                self.report(attempt, "bad_response")
                raise UpstreamFailed(f"{self.who}: {type(exc).__name__}: "
                                     f"{str(exc)[:200]}") from None
            if 200 <= resp.status < 300:
                return resp
            data = b""
            try:
                while len(data) < ERROR_READ_BYTES and (chunk := await resp.content.readany()):
                    data += chunk
            except (aiohttp.ClientError, OSError):
                pass
            finally:
                resp.close()
            self.report(attempt, resp.status)
            raise status_error(self.who, resp.status, data[:ERROR_READ_BYTES], resp.headers)
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def read(self, resp: aiohttp.ClientResponse, attempt: Attempt) -> bytes:
        """The whole body, at most ``max_response_bytes`` (decompressed), else 502."""
        limit, parts, size, complete = self.options.max_response_bytes, [], 0, False
        try:
            if resp.content_length is not None and resp.content_length > limit \
                    and not resp.headers.get("content-encoding"):
                raise self.too_large(attempt)
            while chunk := await resp.content.readany():
                size += len(chunk)
                if size > limit:
                    raise self.too_large(attempt)
                parts.append(chunk)
            complete = True
        except aiohttp.ServerTimeoutError:
            self.report(attempt, "timeout")
            raise UpstreamTimeout(f"{self.who}: the answer stalled for timeout_ms",
                                  before_response=False) from None
        except (aiohttp.ClientError, OSError) as exc:
            self.report(attempt, "disconnected")
            raise UpstreamFailed(f"{self.who}: the response broke off "
                                 f"({type(exc).__name__})") from None
        finally:
            if complete:
                resp.release()
            else:
                resp.close()
        self.report(attempt, resp.status)
        return b"".join(parts)

    def too_large(self, attempt: Attempt) -> UpstreamFailed:
        self.report(attempt, "too_large")
        return UpstreamFailed(f"{self.who}: the response exceeds max_response_bytes "
                              f"({self.options.max_response_bytes})")

    def cut_short(self, tried: list[Attempt], exc: BaseException) -> None:
        """Report the last attempt, ended by our timeout or a cancellation."""
        if tried:
            self.report(tried[-1], "timeout" if isinstance(exc, TimeoutError) else "cancelled")

    async def call(self, path: str, doc: dict[str, Any], ctx: RequestContext
                   ) -> tuple[bytes, Mapping[str, str]]:
        """POST ``doc`` as JSON: the answer's body and headers (the non-streaming path),
        all within the attempt's budget."""
        budget = self.budget_s(ctx)
        body = orjson.dumps(doc)
        tried: list[Attempt] = []
        resp = None
        try:
            async with asyncio.timeout(budget):
                resp = await self.post(path, body, self.headers(ctx, budget), tried, ctx.trace)
                data = await self.read(resp, tried[-1])
        except TimeoutError as exc:
            self.cut_short(tried, exc)
            raise UpstreamTimeout(f"{self.who}: no answer within {budget * 1e3:.0f} ms",
                                  before_response=resp is None) from None
        except asyncio.CancelledError as exc:
            self.cut_short(tried, exc)
            raise
        return data, resp.headers


_ID_MAX = 128


def header_safe_id(request_id: str) -> str:
    """The request id to send upstream as ``x-request-id``: the client's when it is visible
    ASCII of at most 128 characters (what a header value may carry), else a fresh one. (A V2
    body's ``id`` is any JSON string: a control character in it must not reach a header.)"""
    if request_id and len(request_id) <= _ID_MAX and request_id.isascii() \
            and request_id.isprintable():
        return request_id
    return uuid.uuid4().hex
