"""API keys: who is calling, and which models they may use.

A key comes as ``Authorization: Bearer <key>`` (what the OpenAI SDK sends) or ``X-API-Key``.
Keys are compared in constant time against every configured key (no early exit, so timing
does not tell how much of a key matched, nor which one), and are never logged or echoed.
With no keys configured the server is open and every caller is the tenant ``anonymous``.
"""

from __future__ import annotations

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

    def check_model(self, model: str) -> None:
        if self.models is not None and model not in self.models:
            raise Forbidden(f"tenant '{self.name}' may not use model '{model}'", param="model")


OPEN = Tenant(ANONYMOUS, None)


class Authenticator:
    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self._keys = [(k.key.encode(), Tenant(k.tenant, frozenset(k.models) or None,
                                              k.priority)) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, name: str) -> Tenant:
        """The tenant called ``name`` (with its model list), for work accepted earlier."""
        for _, tenant in self._keys:
            if tenant.name == name:
                return tenant
        return Tenant(name, None)

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
