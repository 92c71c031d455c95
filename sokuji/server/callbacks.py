"""Job callbacks without SSRF: vet the URL, pin the address, sign the body, say little.

A client names ``X-Sokuji-Callback-Url``; the server will POST the job's result there. That
makes the server a client of any address a tenant picks, so:

- **Shape** (at submit): http or https, no userinfo, a host, a port in 1..65535, at most
  ``MAX_URL_CHARS`` characters of RFC 3986's set (no backslash, space or non-ASCII: parsers
  that disagree about such URLs are how filters get bypassed).
- **Address** (at submit, for a fast 400, and again before every delivery attempt, since DNS
  can change): the host is resolved off the event loop and refused if ANY of its addresses is
  loopback, private, link-local, multicast, reserved, unspecified, shared (100.64/10), one of
  those wrapped in IPv4-mapped, 6to4 or NAT64 form, or a cloud metadata endpoint, unless an
  allowlist permits it: ``jobs.callback_allow`` (every tenant's) plus the submitting key's
  ``callback_allow``. An entry is a host name (any address it resolves to) or a network
  holding the address. A metadata address is reached only through an entry that is exactly
  that address: never through a name, nor a wider network.
- **One answer**: every address-policy refusal says the same (``POLICY_REFUSAL``), at submit
  and in the job's ``callback`` field (``refused``): which rule, and what the name resolved
  to, would map the inside of the network for whoever asks. The server log has the detail.
- **Lookups** (``Resolver``): the system resolver, in a small pool of threads of its own (a
  slow DNS zone cannot starve the threads inference uses), each lookup bounded by a timeout,
  and no more lookups at once than threads, nor than ``PER_TENANT_LOOKUPS`` per tenant: past
  either, 429 at once (a lookup past its timeout counts until its thread is free).
- **Pinning**, **signature**, **discretion about the receiver**: ``callback_delivery.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import re
import socket
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from sokuji.errors import InvalidInput, Overloaded

log = logging.getLogger(__name__)
CALLBACK_HEADER = "x-sokuji-callback-url"
MAX_URL_CHARS = 2048
POLICY_REFUSAL = "the host is not an allowed public destination"
RESOLVER_THREADS = 8
"""Lookups at once, all tenants together (each has a thread: none waits in a queue)."""
PER_TENANT_LOOKUPS = 2
LOOKUP_RETRY_AFTER_S = 1

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_URL_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+")
METADATA_HOSTS = frozenset({"metadata", "metadata.google.internal", "metadata.goog",
                            "instance-data", "instance-data.ec2.internal"})
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "169.254.170.23",  # AWS, Azure, GCP; ECS; EKS
    "fd00:ec2::254", "fd00:ec2::23", "100.100.100.200", "192.0.0.192"))  # AWS v6; Alibaba; OCI
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_TEREDO = ipaddress.ip_network("2001::/32")


class CallbackRefused(InvalidInput):
    """The callback URL breaks the policy: 400 at submit, ``refused`` at delivery.
    ``lookup_failed``: the host did not resolve (in time); at delivery that is worth another
    attempt, unlike an address the policy refuses."""

    def __init__(self, reason: str, *, lookup_failed: bool = False) -> None:
        super().__init__(f"{CALLBACK_HEADER} refused: {reason}", param=CALLBACK_HEADER)
        self.reason = reason
        self.lookup_failed = lookup_failed


@dataclass(frozen=True)
class Target:
    url: str
    host: str
    """Lower case, without brackets or a trailing dot."""
    port: int
    address: str | None = None
    """The vetted address to connect to (after ``CallbackPolicy.vet``)."""


def parse(url: str) -> Target:
    """The URL's shape, or ``CallbackRefused`` saying what is wrong with it."""
    if len(url) > MAX_URL_CHARS:
        raise CallbackRefused(f"longer than {MAX_URL_CHARS} characters")
    if not _URL_CHARS.fullmatch(url):
        raise CallbackRefused("only the characters of RFC 3986 are allowed (no spaces, "
                              "backslashes or non-ASCII; percent-encode them)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise CallbackRefused(f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise CallbackRefused("the scheme must be http or https")
    if "@" in parts.netloc:
        raise CallbackRefused("user information (user:password@) is not allowed")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise CallbackRefused("the URL has no host")
    if "%" in host:
        raise CallbackRefused("the host may not be percent-encoded (nor carry an IPv6 zone)")
    if port == 0:
        raise CallbackRefused("port 0 is not a port")
    return Target(url, host, port or (443 if parts.scheme == "https" else 80))


def _embedded(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (IPv4-mapped, 6to4, NAT64), if any."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    embedded = ip.ipv4_mapped or ip.sixtofour
    if embedded is None and ip in _NAT64:
        embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return embedded


def address_problem(ip: IPAddress) -> str | None:
    """Why a callback may not go to ``ip`` (a short category, for the log), or None for a
    public address. IPv4 inside IPv6 (mapped, 6to4, NAT64) is judged by what it carries."""
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    embedded = _embedded(ip)
    if embedded is not None:
        return address_problem(embedded)
    if ip in _NAT64_LOCAL or ip in _TEREDO:
        return "a tunnelled address"
    for flag, name in (("is_loopback", "a loopback"), ("is_unspecified", "an unspecified"),
                       ("is_link_local", "a link-local"), ("is_multicast", "a multicast")):
        if getattr(ip, flag):
            return f"{name} address"
    if ip in _SHARED:
        return "a shared (carrier-grade NAT) address"
    if ip.is_reserved:
        return "a reserved address"
    if ip.is_private:
        return "a private address"
    if not ip.is_global:
        return "a reserved address"
    return None


@dataclass(frozen=True)
class Allowlist:
    """Hosts and networks callbacks may reach although they are internal."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def of(cls, *lists: Iterable[str]) -> Allowlist:
        """From config entries (host names, IP addresses or CIDR networks), merged."""
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in (e for entries in lists for e in entries):
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                hosts.add(entry.lower().rstrip("."))
        return cls(frozenset(hosts), tuple(networks))

    def permits(self, host: str, ip: IPAddress) -> bool:
        """Whether ``ip``, one of ``host``'s addresses, may be reached whatever it is. A
        metadata address (also inside IPv6) only through an entry that is exactly it."""
        forms = [ip] if (inner := _embedded(ip)) is None else [ip, inner]
        if any(form in METADATA_ADDRESSES for form in forms):
            return any(net.prefixlen == net.max_prefixlen and form in net
                       for net in self.networks for form in forms)
        return host in self.hosts or any(form in net for net in self.networks for form in forms)


def lookup(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, by the system resolver (blocking)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Resolver:
    """DNS lookups in threads of their own, bounded in time and in number (module
    docstring)."""

    def __init__(self, timeout_s: float, threads: int = RESOLVER_THREADS,
                 per_tenant: int = PER_TENANT_LOOKUPS) -> None:
        self.timeout_s = timeout_s
        self.max_in_flight = threads
        self.per_tenant = per_tenant
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="sokuji-dns")
        self._in_flight = 0
        self._by_tenant: collections.Counter[str] = collections.Counter()

    async def resolve(self, host: str, port: int, tenant: str) -> list[str]:
        """``host``'s addresses; ``TimeoutError`` past ``timeout_s``, ``OSError`` if it does
        not resolve, ``Overloaded`` (429) when the lookups at once are at their bound."""
        if self._in_flight >= self.max_in_flight:
            raise Overloaded("too many callback host lookups are in progress; retry shortly",
                             retry_after_s=LOOKUP_RETRY_AFTER_S)
        if self._by_tenant[tenant] >= self.per_tenant:
            raise Overloaded(f"tenant '{tenant}' already has {self.per_tenant} callback host "
                             "lookups in progress; retry shortly",
                             retry_after_s=LOOKUP_RETRY_AFTER_S)
        loop = asyncio.get_running_loop()
        self._in_flight += 1
        self._by_tenant[tenant] += 1

        def finished(_: Future[list[str]]) -> None:  # in the lookup's thread, or on cancel
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._release, tenant)

        work = self._pool.submit(lookup, host, port)
        work.add_done_callback(finished)
        return await asyncio.wait_for(asyncio.wrap_future(work), self.timeout_s)

    def _release(self, tenant: str) -> None:
        self._in_flight -= 1
        self._by_tenant[tenant] -= 1
        if self._by_tenant[tenant] <= 0:
            del self._by_tenant[tenant]

    def close(self) -> None:
        """Stop taking lookups; threads still blocked in the resolver end on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class CallbackPolicy:
    """Which callback URLs the server will POST to (see the module docstring)."""

    def __init__(self, allow: Iterable[str] = (), resolver: Resolver | None = None) -> None:
        self.allow = Allowlist.of(allow)
        self.resolver = resolver or Resolver(timeout_s=5.0)

    async def vet(self, url: str, tenant: str, allow: Allowlist | None = None) -> Target:
        """The parsed URL with the address to connect to. ``CallbackRefused``: the URL's
        shape (saying what), or its host name or ANY address the host resolves to, is not
        allowed by ``allow`` (default: the global list) (saying ``POLICY_REFUSAL`` only).
        ``Overloaded``: the lookups ``tenant`` may have at once are in progress."""
        target = parse(url)
        allow = allow or self.allow

        def refuse(detail: str, lookup_failed: bool = False) -> CallbackRefused:
            log.info("callback to host %r refused: %s", target.host, detail)
            return CallbackRefused(POLICY_REFUSAL, lookup_failed=lookup_failed)

        if target.host in METADATA_HOSTS and target.host not in allow.hosts:
            raise refuse("a cloud metadata host name")
        try:
            literal: IPAddress | None = ipaddress.ip_address(target.host)
        except ValueError:
            literal = None
        if literal is not None:
            addresses = [str(literal)]
        else:
            try:
                addresses = await self.resolver.resolve(target.host, target.port, tenant)
            except (OSError, TimeoutError, UnicodeError) as exc:
                raise refuse(f"does not resolve ({type(exc).__name__})", True) from None
            if not addresses:
                raise refuse("resolves to no address", True)
        for address in addresses:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
            if allow.permits(target.host, ip):
                continue
            problem = address_problem(ip)
            if problem is not None:
                raise refuse(f"resolves to {problem} ({address})")
        return Target(target.url, target.host, target.port, addresses[0])
