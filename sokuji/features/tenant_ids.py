"""A tenant's entity ids in a shared feature store: ``scoped(tenant, id)``.

With API keys, a feature step looks a client's id up as ``<tenant>:<id>``, with ``%`` and
``:`` in the tenant's name percent-encoded (``%25``, ``%3A``), so the first ``:`` always ends
the tenant and no (tenant, id) pair shares its row with another: tenant ``acme`` asking for
``corp:ada`` reads ``acme:corp:ada``, tenant ``acme:corp`` asking for ``ada`` reads
``acme%3Acorp:ada``. A tenant name without ``%`` or ``:`` reads as written. Write your own
store's rows with this function. An open server (no keys) looks ids up as given; a keyed
server never does (``Resources.keyed``, decided once at start-up), whatever a tenant is
called.
"""

from __future__ import annotations


def scoped(tenant: str, entity_id: str) -> str:
    """The row of ``tenant``'s entity ``entity_id``: injective in the pair."""
    return f"{tenant.replace('%', '%25').replace(':', '%3A')}:{entity_id}"
