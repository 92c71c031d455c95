"""The names the server answers to in a request's ``Host`` header: the defence against DNS
rebinding.

A page on ``evil.example`` whose name is made to resolve to 127.0.0.1 can have a browser on
the server's machine send requests to Sokuji and read the answers: same origin for the
browser, yet the request still says ``Host: evil.example:8000``. Refusing names the server
is not known by closes that. The answer is 421 (Misdirected Request: not this server's
name), on every path, before authentication or any other work.

``allowed_hosts`` (config): a host name, an IP address, ``*.example.com`` (any name under
it) or ``*``. Ports are not compared (the port is the listener's business). Unset:

- bound to a loopback address (``127.0.0.1``, the default, ``::1``, ``localhost``):
  ``localhost``, ``127.0.0.1``, ``::1`` and the bound address;
- bound to anything else (``0.0.0.0``, a LAN address): any name. The server is meant to be
  reached by names this process cannot know (a load balancer's, a DNS alias), so API keys
  are the protection there; set ``allowed_hosts`` to the names clients use to add this one.

A request without a ``Host`` header (HTTP/1.0) is let through: browsers always send one.
The decision for a header value is kept (at most ``KEEP`` values), so a request costs one
dictionary lookup.
"""

from __future__ import annotations

import ipaddress

from sokuji.config import ServerConfig
from sokuji.server.failures import ErrorStyle, error_body
from sokuji.server.http import JSON, Reply

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
KEEP = 1024
"""Header values whose decision is kept (beyond: decided each time, not kept)."""
STATUS = 421


def _loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _name(value: str) -> str | None:
    """The name in a ``Host`` value, lowercased, without its port or a trailing dot; None
    when it is not a host[:port] at all."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        end = value.find("]")
        if end < 0 or (value[end + 1:] and not _port(value[end + 1:])):
            return None
        return value[1:end]
    name, colon, port = value.partition(":")
    if colon and not _port(colon + port):
        return None
    return name.rstrip(".")


def _port(rest: str) -> bool:
    return rest.startswith(":") and 1 < len(rest) <= 6 and rest[1:].isdigit()


class AllowedHosts:
    """The names a ``Host`` header may carry. Build with ``of``."""

    def __init__(self, entries: tuple[str, ...]) -> None:
        self.names = frozenset(e.lower().rstrip(".").strip("[]") for e in entries
                               if not e.startswith("*."))
        self.suffixes = tuple(e[1:].lower().rstrip(".") for e in entries if e.startswith("*."))
        """``*.example.com`` as ``.example.com``: any name that ends so."""
        self._known: dict[str, bool] = {}

    @classmethod
    def of(cls, config: ServerConfig) -> AllowedHosts | None:
        """What ``config`` allows; None: any name (nothing to check)."""
        entries = config.allowed_hosts
        if not entries:
            bound = [config.host, config.ray.http_host or config.host]
            if not all(_loopback(h) for h in bound):
                return None
            entries = (*LOOPBACK_NAMES, *bound)
        if "*" in entries:
            return None
        return cls(entries)

    def allows(self, value: str | None) -> bool:
        """Whether a request whose ``Host`` header is ``value`` (None: none) is answered."""
        if value is None:
            return True
        known = self._known.get(value)
        if known is None:
            name = _name(value)
            known = name is not None and (name in self.names or any(
                name.endswith(s) for s in self.suffixes))
            if len(self._known) < KEEP:
                self._known[value] = known
        return known

    def allows_raw(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """``allows`` over an ASGI scope's raw headers (every ``Host`` one of them)."""
        return all(self.allows(v.decode("latin-1")) for k, v in headers if k == b"host")


def refusal(path: str) -> Reply:
    """The answer to a request for a name this server does not answer to (421)."""
    style = ErrorStyle.OPENAI if path.startswith("/v1/") else ErrorStyle.V2
    message = ("this server does not answer to that Host name; if it is one of its own, "
               "add it to allowed_hosts")
    return Reply(STATUS, error_body(style, STATUS, "misdirected_request", message),
                 {"content-type": JSON})
