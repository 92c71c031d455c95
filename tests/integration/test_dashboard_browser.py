"""The dashboard in a real browser (Debian's Chromium driven by Playwright) against a real
``sokuji serve``: the page loads, its charts follow the load, nothing fails in the console or
on the network; with keys configured it asks for a key and refuses a tenant's; a page from a
name rebound to 127.0.0.1 (DNS rebinding) is refused.

``SOKUJI_DASHBOARD_SCREENSHOT=docs/dashboard.png`` saves the loaded page there."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        "--host-resolver-rules=MAP rebound.test 127.0.0.1"]  # the attacker's rebound name
ADMIN, TENANT = "dash-admin-key-0123", "dash-tenant-key-0123"
SYNTH = """
[[models]]
name = "synth"
runtime = "synthetic"
max_batch_size = 8
options = {base_ms = 2.0, per_item_ms = 0.5, distribution = "lognormal"}
slo = {p99_ms = 50.0, error_rate = 0.01, window_s = 60.0}
"""
LLM = """
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 2
context_size = 256
max_new_tokens = 16
"""
KEYS = f"""
[[api_keys]]
key = "{ADMIN}"
tenant = "ops"
admin = true
[[api_keys]]
key = "{TENANT}"
tenant = "acme"
""" + SYNTH.replace("slo = ", "# slo = ")  # (and no SLO: the page says so)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent (Debian's chromium package; `make test` installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


class Watch:
    """What a page said in its console and on the network."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        self.statuses: list[tuple[int, str]] = []
        page.on("console", self._console)
        page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: self.errors.append(f"failed: {r.url}"))
        page.on("response", self._response)

    def _console(self, message: Any) -> None:
        if message.type == "error":  # (CSP violations are reported as errors too)
            self.errors.append(message.text)

    def _response(self, response: Any) -> None:
        if response.status >= 400:
            self.statuses.append((response.status, response.url))


def load(url: str, stop: threading.Event) -> list[threading.Thread]:
    """Encoder requests (a quarter of them repeats: cache hits) and short generations."""
    def encode() -> None:
        rng = random.Random()
        with httpx.Client(base_url=url, timeout=30) as c:
            while not stop.is_set():
                text = "again" if rng.random() < 0.25 \
                    else f"text {rng.random()}" * rng.randint(1, 9)
                c.post("/v2/models/synth/infer", json={"inputs": [
                    {"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]})

    def generate() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not stop.is_set():
                c.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Name a river."}]})

    threads = [threading.Thread(target=encode) for _ in range(3)]
    threads.append(threading.Thread(target=generate))
    for t in threads:
        t.start()
    return threads


def legend(chart: str, series: str) -> str:
    return f'[data-chart="{chart}"] .v[data-series="{series}"]'


IS_NUMBER = ("s => { const e = document.querySelector(s);"
             " return !!e && /^[0-9.]+/.test(e.textContent) }")
SLO_COUNTED = ("() => { const r = document.querySelector('[data-slo=\"synth/\"]');"
               " return !!r && Number(r.children[5].textContent) > 0 }")  # requests column


def until(page: Any, predicate: str, arg: Any = None, timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` (a JavaScript function) in the page until it is true. (Playwright's
    own ``wait_for_function`` evaluates a string, which the page's CSP rightly forbids.)"""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(predicate, arg):
        if time.monotonic() > deadline:
            raise TimeoutError(f"never true: {predicate} ({arg})")
        page.wait_for_timeout(100)


def test_the_page_follows_the_load(browser: Any) -> None:
    with sokuji_server(SYNTH + LLM) as url:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        watch = Watch(page)
        page.goto(f"{url}/dashboard")
        until(page, "() => Number(document.body.dataset.points || 0) >= 1")
        assert page.locator("[data-model]").evaluate_all("l => l.map(e => e.dataset.model)") \
            == ["synth", "smollm2"]
        canvas = '[data-chart="synth/throughput"] canvas'
        before = page.eval_on_selector(canvas, "c => c.toDataURL()")
        points = int(page.evaluate("document.body.dataset.points"))
        assert page.text_content(legend("synth/throughput", "ok")).startswith("0")

        stop = threading.Event()
        threads = load(url, stop)
        try:
            until(page, "s => parseFloat(document.querySelector(s).textContent) > 0",
                  legend("synth/throughput", "ok"))
            for chart, series in (("synth/latency", "p99"), ("synth/stages", "infer"),
                                  ("synth/batch", "batch_mean"), ("synth/cache", "cache_hit"),
                                  ("smollm2/ttft", "ttft_p50"), ("smollm2/itl", "itl_p99"),
                                  ("smollm2/tokens", "tokens")):
                until(page, IS_NUMBER, legend(chart, series))
            until(page, SLO_COUNTED)  # the SLO's row, with traffic counted
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert int(page.evaluate("document.body.dataset.points")) > points
        assert page.eval_on_selector(canvas, "c => c.toDataURL()") != before
        assert page.locator('[data-chart="synth/batch-sizes"] .legend').get_attribute(
            "data-total") not in (None, "0")
        status = page.text_content("#status") or ""
        assert status.startswith("live"), status
        shot = os.environ.get("SOKUJI_DASHBOARD_SCREENSHOT")
        if shot:
            page.select_option("#window", "60")
            page.screenshot(path=shot, full_page=True)
        page.close()
        assert watch.errors == [] and watch.statuses == []
        rebinding(browser, url)


def rebinding(browser: Any, url: str) -> None:
    """The attack on an open server (no keys): a page served from ``rebound.test`` whose name
    then resolves to 127.0.0.1 is same-origin with the server for the browser, so it could
    read /dashboard/data and /metrics. The request carries its own name: 421."""
    rebound = url.replace("127.0.0.1", "rebound.test")
    page = browser.new_page()
    response = page.goto(f"{rebound}/dashboard")
    assert response is not None and response.status == 421
    page.close()
    port = url.rsplit(":", 1)[1]
    for path in ("/dashboard/data", "/metrics", "/v2/models/stats"):
        assert httpx.get(url + path, headers={"host": f"rebound.test:{port}"}
                         ).status_code == 421, path
        assert httpx.get(url + path, headers={"host": f"localhost:{port}"}).status_code == 200
    r = httpx.post(f"{url}/v2/models/synth/infer", headers={"host": f"rebound.test:{port}"},
                   json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                     "data": ["x"]}]})
    assert r.status_code == 421


def test_the_page_asks_for_an_admin_key(browser: Any) -> None:
    with sokuji_server(KEYS) as url:  # (metrics_require_key: the default)
        page = browser.new_page()
        watch = Watch(page)
        page.goto(f"{url}/dashboard")
        page.wait_for_selector("#key-panel:not([hidden])")
        assert "admin" in (page.text_content("#key-reason") or "")
        assert page.locator("[data-model]").count() == 0  # nothing shown without a key

        page.fill("#key-input", TENANT)
        page.press("#key-input", "Enter")
        until(page, "() => document.querySelector('#status').textContent.includes('403')")
        assert "acme" in (page.text_content("#key-reason") or "")  # the server's reason

        page.fill("#key-input", ADMIN)
        page.click("#key-form button")
        page.wait_for_selector('[data-model="synth"]')
        page.wait_for_selector("#key-panel", state="hidden")
        page.wait_for_selector("#slo-body .none")  # "No SLO configured: ..."
        assert page.evaluate("sessionStorage.getItem('sokuji.dashboard.key')") == ADMIN
        page.close()
        # the browser reports the 401 and the 403 it was answered, and nothing else
        assert sorted(s for s, _ in watch.statuses) == [401, 403]
        assert all("status of 40" in e for e in watch.errors), watch.errors


def test_the_page_pages_through_a_bounded_answer(browser: Any) -> None:
    """An answer of /dashboard/data is bounded (``more``, ``upto``): the page asks again at
    once from ``upto`` until it has everything, and draws it all. Each answer is cut to one
    point here, as a server with more than its bound's worth kept would cut it."""
    with sokuji_server(SYNTH) as url:
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/dashboard/data").json()["seq"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        asked: list[str] = []

        def one_point(route: Any) -> None:
            asked.append(route.request.url)
            response = route.fetch()
            doc = response.json()
            if len(doc["points"]) > 1:
                doc["points"] = doc["points"][:1]
                doc["upto"] = doc["points"][0]["seq"]
                doc["more"] = doc["upto"] < doc["seq"]
            route.fulfill(response=response, json=doc)

        page = browser.new_page()
        watch = Watch(page)
        page.route("**/dashboard/data*", one_point)
        page.goto(f"{url}/dashboard")
        until(page, "() => Number(document.body.dataset.points || 0) >= 4")
        sinces = [u.partition("since=")[2] for u in asked]
        assert sinces[0] == "" and sinces[1:4] == ["1", "2", "3"], asked  # one after another
        seqs = page.evaluate("() => document.body.dataset.seq")
        assert int(seqs) >= 4
        page.close()
        assert watch.errors == [] and watch.statuses == []
