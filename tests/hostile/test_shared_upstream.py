"""Finding 3 replayed: an upstream model whose credential is shared by every tenant
(``api_key_env``, no ``tenant_keys_env``: docs/routing.md's own example). Tenant ``b`` sends the
text tenant ``a`` embedded; the upstream's cache answers both under the one key, and the
upstream's own timing came back in the response (0.28 ms for a's text against 4.8 ms for a
fresh one). Fixed means either the server refuses such a config for keyed tenants, or
nothing the upstream reports reaches the response."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.hostile.conftest import start, upstream_config
from tests.integration.serving import wait_ready

pytestmark = pytest.mark.integration

KEYS = {"a": "shared-probe-a-0123", "b": "shared-probe-b-0123"}
SHARED = "shared-upstream-key-0123"


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[subprocess.Popen[bytes], str]]:
    tmp: Path = tmp_path_factory.mktemp("shared")
    env = {**os.environ, "HOSTILE_SHARED_UP": SHARED}
    up, up_url = start(upstream_config(tmp / "up", {"shared": SHARED}), tmp, "up", env)
    keys = "".join(f'[[api_keys]]\nkey = "{k}"\ntenant = "{t}"\n' for t, k in KEYS.items())
    proc, url = start(f'cache_dir = "{tmp / "front"}"\nbuiltin_pipelines = false\n{keys}'
                      '[[models]]\nname = "far"\nruntime = "upstream"\n[models.options]\n'
                      f'protocol = "v2"\nurl = "{up_url}"\nupstream_model = "enc"\n'
                      'api_key_env = "HOSTILE_SHARED_UP"\n', tmp, "front", env)
    try:
        wait_ready(up, f"{up_url}/v2/health/ready", timeout_s=120)
        with contextlib.suppress(RuntimeError):  # refused at start-up: the test reads why
            wait_ready(proc, f"{url}/v2/health/ready", timeout_s=120)
        yield proc, url
    finally:
        for p in (proc, up):
            if p.poll() is None:
                p.terminate()
        for p in (proc, up):
            p.wait(timeout=30)


def _embed(url: str, tenant: str, text: str) -> requests.Response:
    r = requests.post(f"{url}/v2/models/far/infer", timeout=30, json={"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]},
        headers={"Authorization": f"Bearer {KEYS[tenant]}", "cache-control": "no-cache"})
    assert r.status_code == 200, r.text
    return r


def test_a_shared_upstream_credential_tells_no_tenant_what_another_sent(
        front: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = front
    if proc.poll() is not None:
        assert proc.returncode == 2  # refused with a config error: a fix
        return
    secret = "the text only tenant a embedded"
    _embed(url, "a", secret)
    probe = _embed(url, "b", secret)
    timing = probe.headers.get("server-timing", "")
    # Neither the upstream's own time ('upstream 0.28 ms') nor its cache's word comes back.
    assert not re.search(r'desc="upstream [0-9]', timing) and "hit" not in timing, timing
