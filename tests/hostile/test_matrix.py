"""The hostile matrix: every declared kind (``declared.py``) x every mutation that applies to
its inputs and routes (``mutations.py``), against the suite's one real server. Each case:
no 5xx; a 4xx with a reason (naming the limit where the case passes one); the status the
mutation expects; the server's peak memory not grown past a quarter above its peak before the
case; the server still alive and answering the kind's normal request."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from tests.hostile import declared, mutations
from tests.hostile.conftest import Server, auth, post

pytestmark = pytest.mark.integration


def _params() -> list[Any]:
    out = []
    for d in declared.DECLARED.values():
        for m in mutations.MUTATIONS:
            if not m.applies(d):
                continue
            for case in m.cases(d):
                out.append(pytest.param(d, case, id=f"{d.runtime}-{m.name}-{case.id}"))
    return out


PARAMS = _params()


def declares_pixel_limits(server: Server, model: str) -> bool:
    doc = requests.get(f"{server.url}/v2/models/{model}/config", headers=auth("ops"),
                       timeout=10).json()
    return any(k.startswith("limit.") and "pixel" in v["string_value"]
               for k, v in doc.get("parameters", {}).items())


@pytest.mark.parametrize(("d", "case"), PARAMS)
def test_hostile_input(server: Server, d: declared.Declared, case: mutations.Case) -> None:
    if any(case.id.startswith(name) for name in mutations.DANGEROUS):
        # Without the media limits these strips kill the server (finding 1): not sent.
        assert declares_pixel_limits(server, d.model), \
            f"{d.model} declares no pixel limit: a strip would exhaust the server's memory"
    assert post(server, d.normal).status_code == 200  # the kind's own work done once
    before = server.peak_rss()
    answer = case.send(server.url, auth("t1"))
    assert server.alive(), "the server died"
    # The case's memory against the server's own peak before it (models, caches, warm-up).
    assert server.peak_rss() <= 1.25 * before, (before, server.peak_rss())
    if answer.status is None:
        assert case.or_closed, f"no answer at all ({answer.seconds:.1f} s)"
    else:
        assert answer.status < 500, (answer.status, answer.body[:300])
        assert answer.status in case.expect, (answer.status, answer.body[:300])
        if answer.status >= 400:
            reason = answer.reason()
            assert reason, f"a {answer.status} without a reason"
            if case.names:
                assert any(n in reason for n in case.names), (reason, case.names)
    normal = post(server, d.normal)
    assert normal.status_code == 200, normal.text
