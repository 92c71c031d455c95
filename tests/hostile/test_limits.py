"""Every served model of every kind states its cost bound (``core/limits.py``), shown as
``limit.<key>`` parameters of ``GET /v2/models/{m}/config``; and for each limit whose
declaration (``declared.py``) says how to pass it, a request just past it is refused with
413 naming it, one at it is answered, and the server goes on answering."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from tests.hostile import declared
from tests.hostile.conftest import Server, auth, post

pytestmark = pytest.mark.integration


def stated(server: Server, model: str) -> dict[str, float]:
    """The model's limits as its config shows them: key -> value."""
    doc = requests.get(f"{server.url}/v2/models/{model}/config", headers=auth("ops"),
                       timeout=10).json()
    return {k.removeprefix("limit."): float(v["string_value"].split()[0])
            for k, v in doc.get("parameters", {}).items() if k.startswith("limit.")}


def _every_kind() -> list[Any]:
    return [pytest.param(d, id=d.runtime) for d in declared.DECLARED.values()]


@pytest.mark.parametrize("d", _every_kind())
def test_every_model_states_its_limits(server: Server, d: declared.Declared) -> None:
    limits = stated(server, d.model)
    assert limits, f"{d.model} ({d.runtime}) states no limits"
    assert all(v > 0 for v in limits.values()), limits


def _exceedable() -> list[Any]:
    return [pytest.param(d, key, id=f"{d.runtime}-{key}")
            for d in declared.DECLARED.values() for key in d.exceed]


@pytest.mark.parametrize(("d", "key"), _exceedable())
def test_a_request_just_past_a_limit_is_refused_naming_it(server: Server, d: declared.Declared,
                                                          key: str) -> None:
    limits = stated(server, d.model)
    assert key in limits, f"{d.model} no longer states {key}: {sorted(limits)}"
    value = limits[key]
    r = post(server, d.exceed[key](value))
    assert r.status_code == 413, r.text
    reason = r.json()["error"]
    # The body's bound is the server's (server/http.py): its message names the value.
    assert (f"{value:g}" if key == "max_request_bytes" else key) in str(reason), reason
    if key != "max_request_bytes":  # (a body of exactly the limit is no request of this kind)
        at = post(server, d.exceed[key](value - 1))
        if key in d.at_limit_refused_by_steps:
            assert at.status_code != 413, at.text
        else:
            assert at.status_code == 200, at.text
    assert post(server, d.normal).status_code == 200
