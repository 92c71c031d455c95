"""The hostile suite's one ``sokuji serve``, shared by every test of the package: a model of
every declared kind (``declared.py``), API keys for two tenants, an admin, a tenant named
``anonymous`` and one whose name carries a separator (``t1:corp``), over real HTTP. Its
upstream kind talks to a second, small ``sokuji serve`` (a synthetic encoder ``enc``) with
one shared credential; the echo plug-in is installed by pip into a directory of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.conftest import CACHE_DIR, ROOT
from tests.hostile import declared
from tests.integration.serving import free_port, wait_ready

KEYS = {"t1": "hostile-t1-key-0001", "t2": "hostile-t2-key-0002",
        "ops": "hostile-ops-key-0003", "anonymous": "hostile-anon-key-0004",
        "t1:corp": "hostile-corp-key-0005"}
"""Tenant -> its API key (``ops`` is the admin)."""
UPSTREAM_KEY = "hostile-upstream-shared-0006"


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@dataclass(frozen=True)
class Server:
    url: str
    upstream: str
    proc: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.proc.poll() is None


def _keys() -> str:
    return "".join(f'[[api_keys]]\nkey = "{key}"\ntenant = "{tenant}"\n'
                   + ("admin = true\n" if tenant == "ops" else "")
                   for tenant, key in KEYS.items())


def _start(body: str, tmp: Path, name: str, env: dict[str, str]) -> tuple[
        subprocess.Popen[bytes], str]:
    port = free_port()
    config = tmp / f"{name}.toml"
    config.write_text(f'port = {port}\nlog_level = "error"\n{body}')
    proc = subprocess.Popen([sys.executable, "-m", "sokuji", "serve", "--config", str(config)],
                            stdout=subprocess.DEVNULL, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _install_plugin(tmp: Path) -> Path:
    src = tmp / "plugin-src"
    shutil.copytree(ROOT / "tests" / "plugin_kind", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", "--quiet",
                    "--target", str(tmp / "site"), str(src)],
                   check=True, capture_output=True, timeout=120)
    return tmp / "site"


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="sokuji-hostile-") as name:
        tmp = Path(name)
        site = _install_plugin(tmp)
        path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "HOSTILE_UPSTREAM_KEY": UPSTREAM_KEY}
        up, up_url = _start(
            f'cache_dir = "{tmp / "up"}"\nbuiltin_pipelines = false\n'
            f'[[api_keys]]\nkey = "{UPSTREAM_KEY}"\ntenant = "shared"\n'
            '[[models]]\nname = "enc"\nruntime = "synthetic"\nwarmup = false\n'
            'options = { base_ms = 0.0 }\n', tmp, "upstream", env)
        models = "".join(d.config.replace("{upstream}", up_url)
                         for d in declared.DECLARED.values())
        main, url = _start(
            f'cache_dir = "{CACHE_DIR}"\nbuiltin_pipelines = false\n'
            f'max_request_bytes = {declared.SERVER_BYTES}\n'
            f'[jobs]\npath = "{tmp / "jobs.sqlite"}"\n{_keys()}{models}', tmp, "hostile", env)
        try:
            wait_ready(up, f"{up_url}/v2/health/ready", timeout_s=120)
            wait_ready(main, f"{url}/v2/health/ready", timeout_s=240)
            yield Server(url, up_url, main)
        finally:
            for proc in (main, up):
                if proc.poll() is None:
                    proc.terminate()
            for proc in (main, up):
                proc.wait(timeout=30)


def post(server: Server, request: declared.Request, tenant: str = "t1",
         **headers: str) -> requests.Response:
    return requests.post(server.url + request.path, data=request.body, timeout=60,
                         headers={**request.headers, **auth(tenant), **headers})
