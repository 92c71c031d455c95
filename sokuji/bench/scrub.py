"""Secrets kept out of every report: header values that carry credentials, passwords in URLs.

``sokuji bench --header "Authorization: Bearer sk-..."`` must not put the key into a JSON
result that gets attached to a ticket or an HTML page that gets published. The header names
stay (a reader needs to know that a key was sent), and an authentication scheme stays
(``Bearer ***``); the credential itself becomes ``***``.

A header is sensitive if its name is a known credential header or contains one of
``SENSITIVE_PARTS`` (``X-Api-Key``, ``X-Auth-Token``, ``Client-Secret`` ...). Scrubbing is
idempotent.
"""

from __future__ import annotations

import copy
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
SENSITIVE_NAMES = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key",
                             "cookie", "set-cookie"})
SENSITIVE_PARTS = ("key", "token", "secret", "auth", "password", "passwd", "cookie",
                   "session", "signature", "credential")
# "Bearer abc", "Basic abc=", "Token abc": an RFC 9110 auth-scheme, then the credential.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]*)\s+\S")
# "Name: value" as given to --header (a token, optional spaces, a colon).
_HEADER = re.compile(r"^\s*([A-Za-z0-9!#$%&'*+.^_`|~-]+)\s*:(.*)$", re.DOTALL)


def is_sensitive(name: str) -> bool:
    """Whether a header (or query parameter) of this name carries a credential."""
    lowered = name.strip().lower()
    return lowered in SENSITIVE_NAMES or any(part in lowered for part in SENSITIVE_PARTS)


def header_value(name: str, value: str) -> str:
    """``value`` as it may appear in a report: masked when ``name`` is sensitive, keeping an
    authentication scheme (``Bearer ***``)."""
    if not is_sensitive(name):
        return value
    scheme = _SCHEME.match(value.strip())
    return f"{scheme.group(1)} {MASK}" if scheme else MASK


def _header_match(text: str) -> re.Match[str] | None:
    m = _HEADER.match(text)
    return None if m is None or m.group(2).startswith("//") else m  # "http://": a URL


def header_arg(text: str) -> str:
    """A ``Name: value`` argument with its value scrubbed (and a URL in a harmless header's
    value scrubbed as a URL); other text unchanged."""
    m = _header_match(text)
    if m is None:
        return text
    name, value = m.group(1), m.group(2).strip()
    if is_sensitive(name):
        return f"{name}: {header_value(name, value)}"
    return f"{name}: {url(value)}" if "://" in value else text


def url(text: str) -> str:
    """``text`` with a password in its user info and sensitive query values masked."""
    try:
        parts = urlsplit(text)
    except ValueError:
        return MASK  # unparsable: it might still hold a secret
    if not parts.scheme or not parts.netloc:
        return text
    netloc, query = parts.netloc, parts.query
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if sep else netloc
    if query:
        query = "&".join(
            f"{k}={MASK}" if sep and is_sensitive(k) else f"{k}{sep}{v}"
            for k, sep, v in (item.partition("=") for item in query.split("&")))
    if (netloc, query) == (parts.netloc, parts.query):
        return text
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def arg(text: str) -> str:
    """One command-line argument: a header, a URL, or ``--flag=either``, scrubbed."""
    if text.startswith("--") and "=" in text:
        flag, _, value = text.partition("=")
        return f"{flag}={arg(value)}"
    if _header_match(text) is not None:
        return header_arg(text)
    return url(text) if "://" in text else text


def headers(values: dict[str, str]) -> dict[str, str]:
    return {k: header_value(k, v) for k, v in values.items()}


def result(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of a bench result with credentials masked in ``command`` and ``config``
    (headers, URL, path). Every report output goes through this."""
    out = dict(doc)
    if isinstance(doc.get("command"), list):
        out["command"] = [arg(a) if isinstance(a, str) else a for a in doc["command"]]
    config = doc.get("config")
    if isinstance(config, dict):
        config = copy.deepcopy(config)
        if isinstance(config.get("header"), list):
            config["header"] = [header_arg(h) if isinstance(h, str) else h
                                for h in config["header"]]
        if isinstance(config.get("headers"), dict):
            config["headers"] = headers(config["headers"])
        for key in ("url", "path"):
            if isinstance(config.get(key), str):
                config[key] = arg(config[key]) if key == "url" else _path(config[key])
        out["config"] = config
    return out


def _path(text: str) -> str:
    """A request path's sensitive query values masked (``/x?api_key=...``)."""
    if "?" not in text:
        return text
    return url("http://h" + text)[len("http://h"):]
