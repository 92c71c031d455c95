"""API keys: who is calling, and which models they may use.

A key comes as ``Authorization: Bearer <key>`` (what the OpenAI SDK sends) or ``X-API-Key``.
Keys are compared in constant time against every configured key (no early exit, so timing
does not tell how much of a key matched, nor which one), and are never logged or echoed.
With no keys configured the server is open and every caller is the tenant ``anonymous``.
Whether keys are configured is the server's setting (``Authenticator.enabled``), never read
from a tenant's name: a keyed tenant may be called ``anonymous`` and gets nothing the open
server's caller stored (feature rows, cache entries, jobs).

A tenant carries what it may do: its models (403 outside them, on the inference path and on
the control plane alike), its default priority class and the highest class it may ask for
(``max_priority``: a header or V2 parameter cannot lift it above), and whether it is an
``admin`` (statistics, and ``/metrics`` and the dashboard's data unless
``metrics_require_key = false``: every tenant's traffic is in them).

Each key has an identity that is not the secret, ``key_id`` (16 hex digits of SHA-256 over
``"sokuji-key:" + key``): work accepted earlier (jobs) records it and runs with exactly that
key's rights as configured now, or not at all if the key is gone (``by_key_id``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from sokuji.config import ApiKey
from sokuji.errors import Forbidden, Unauthorized

ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str] | None
    """None: every model."""
    priority: str | None = None
    """Default priority class of the tenant's requests (None: interactive)."""
    max_priority: str | None = None
    """The highest class its requests may ask for (``batch``: never interactive)."""
    admin: bool = False
    """May read statistics, /metrics and the dashboard's data (every tenant's traffic)."""
    key_id: str = ""
    """The identity of the key that authenticated it (``key_id``); empty: no keys."""

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def check_model(self, model: str) -> None:
        """403 unless the tenant may use ``model``. Call it before looking the model up: a
        name outside the tenant's list gets the same answer whether or not it exists."""
        if not self.may_use(model):
            raise Forbidden(f"tenant '{self.name}' may not use model '{model}'", param="model")


OPEN = Tenant(ANONYMOUS, None, admin=True)
"""The caller when no keys are configured: the server is open, control plane included."""


def key_id(key: str) -> str:
    """A stable name for an API key that is not the key: 16 hex digits of SHA-256 over
    ``"sokuji-key:" + key``. Stored with jobs; it names the key, it cannot be used as one."""
    return hashlib.sha256(b"sokuji-key:" + key.encode()).hexdigest()[:16]


class Authenticator:
    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self._keys = [(k.key.encode(), Tenant(k.tenant, frozenset(k.models) or None,
                                              k.priority, k.max_priority, k.admin,
                                              key_id(k.key)))
                      for k in keys]
        self._by_id = {tenant.key_id: tenant for _, tenant in self._keys}

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def by_key_id(self, identity: str) -> Tenant | None:
        """The rights of the key whose ``key_id`` is ``identity``, as configured now; None if
        no configured key has it (removed since, or never there)."""
        return self._by_id.get(identity)

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        if not self._keys:
            return OPEN
        given = headers.get("x-api-key")
        auth = headers.get("authorization")
        if given is None and auth is not None:
            scheme, _, value = auth.partition(" ")
            if scheme.lower() == "bearer":
                given = value.strip()
        if not given:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>' or "
                               "'X-API-Key: <key>'")
        candidate = given.encode()
        found: Tenant | None = None
        for key, tenant in self._keys:
            if hmac.compare_digest(candidate, key):
                found = tenant
        if found is None:
            raise Unauthorized("unknown API key")
        return found

    def admin(self, headers: Mapping[str, str], what: str) -> Tenant:
        """The caller, if its key is marked ``admin`` (anyone with no keys configured): 401
        without a known key, 403 naming ``what`` it may not read otherwise."""
        tenant = self.authenticate(headers)
        if not tenant.admin:
            raise Forbidden(f"tenant '{tenant.name}' may not read {what}: it shows every "
                            "tenant's traffic, so it needs an API key marked admin")
        return tenant
