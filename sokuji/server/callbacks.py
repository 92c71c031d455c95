"""Job callbacks without SSRF: vet the URL, pin the address, sign the body, say little.

A client names ``X-Sokuji-Callback-Url``; the server will POST the job's result there. That
makes the server a client of any address a tenant picks, so:

- **Shape** (at submit): http or https, no userinfo, a host, a port in 1..65535, at most
  ``MAX_URL_CHARS`` characters of RFC 3986's set (no backslash, space or non-ASCII: parsers
  that disagree about such URLs are how filters get bypassed).
- **Address** (at submit, for a fast 400, and again before every delivery attempt, since DNS
  can change): the host is resolved off the event loop and refused if ANY of its addresses is
  loopback, private, link-local, multicast, reserved, unspecified, shared (100.64/10), one of
  those wrapped in IPv4-mapped, 6to4 or NAT64 form, or a cloud metadata endpoint, unless
  ``jobs.callback_allow`` names the host or a network holding the address (metadata
  addresses: only when named exactly).
- **Pinning** (``callback_delivery.py``): the connection goes to the vetted address itself,
  with the URL's Host header and TLS server name, so a second DNS answer cannot redirect it
  (DNS rebinding). Redirects are not followed: a 3xx is a failure.
- **Signature** (``callback_delivery.py``): HMAC-SHA256 over ``timestamp + "." + body``, in
  ``X-Sokuji-Signature: v1=<hex>`` with ``X-Sokuji-Timestamp`` and ``X-Sokuji-Job-Id``.
- **Discretion**: the job's ``callback`` field is ``delivered``, ``failed`` or
  ``refused: <which policy>``, never the remote's status or error text (they would map the
  inside of the network for whoever asks).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from sokuji.errors import InvalidInput

CALLBACK_HEADER = "x-sokuji-callback-url"
MAX_URL_CHARS = 2048

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
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
    """The callback URL breaks the policy: 400 at submit, ``refused: ...`` at delivery."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{CALLBACK_HEADER} refused: {reason}", param=CALLBACK_HEADER)
        self.reason = reason


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


def address_problem(ip: IPAddress) -> str | None:
    """Why a callback may not go to ``ip`` (a short category), or None for a public address.
    IPv4 inside IPv6 (mapped, 6to4, NAT64) is judged by the IPv4 address it carries."""
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
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


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver, in the loop's executor)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class CallbackPolicy:
    """Which callback URLs the server will POST to (see the module docstring)."""

    def __init__(self, allow: Iterable[str] = (), resolve_timeout_s: float = 5.0) -> None:
        self.hosts: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allow:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.hosts.add(entry.lower().rstrip("."))
        self.resolve_timeout_s = resolve_timeout_s

    def _allowed(self, ip: IPAddress) -> bool:
        exact = ip.max_prefixlen
        return any(ip in net and (ip not in METADATA_ADDRESSES or net.prefixlen == exact)
                   for net in self.networks if net.version == ip.version)

    def check_address(self, target: Target, address: str) -> None:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if target.host in self.hosts or self._allowed(ip):
            return
        problem = address_problem(ip)
        if problem is not None:
            raise CallbackRefused(f"host '{target.host}' resolves to {problem} (allow it "
                                  "with jobs.callback_allow)")

    async def vet(self, url: str) -> Target:
        """The parsed URL with the address to connect to; ``CallbackRefused`` if the URL's
        shape, its host's name or ANY address the host resolves to is not allowed."""
        target = parse(url)
        if target.host in METADATA_HOSTS and target.host not in self.hosts:
            raise CallbackRefused(f"host '{target.host}' is a cloud metadata service")
        try:
            literal: IPAddress | None = ipaddress.ip_address(target.host)
        except ValueError:
            literal = None
        if literal is not None:
            addresses = [str(literal)]
        else:
            try:
                addresses = await asyncio.wait_for(resolve(target.host, target.port),
                                                   self.resolve_timeout_s)
            except (OSError, TimeoutError, UnicodeError):
                raise CallbackRefused(f"host '{target.host}' does not resolve") from None
            if not addresses:
                raise CallbackRefused(f"host '{target.host}' does not resolve")
        for address in addresses:
            self.check_address(target, address)
        return Target(target.url, target.host, target.port, addresses[0])
