"""Readiness follows the threads that do the work: a model whose batcher worker thread has
died is not ready (503), nor is the server, and it refuses requests with 503 rather than
queueing them for nobody. (The generation engine's thread: tests/integration/
test_llm_control.py.)"""

from __future__ import annotations

from starlette.testclient import TestClient

from tests.conftest import client_for, synthetic_config
from tests.unit.test_server import v2_body

INFER = "/v2/models/synth/infer"


def ready(client: TestClient) -> tuple[int, int, int]:
    return (client.get("/v2/health/ready").status_code, client.get("/health").status_code,
            client.get("/v2/models/synth/ready").status_code)


def test_a_dead_worker_thread_makes_the_model_and_the_server_unready() -> None:
    with client_for(synthetic_config()) as client:
        assert ready(client) == (200, 200, 200)
        assert client.post(INFER, json=v2_body(["a"])).status_code == 200
        batcher = client.app.inference.repo.models["synth"].served.batcher  # type: ignore[attr-defined]
        batcher._workers._jobs.put(None)  # its worker thread stops, as if it had died
        batcher._workers._threads[0].join(10)
        assert not batcher._workers._threads[0].is_alive()
        assert ready(client) == (503, 503, 503)
        r = client.post(INFER, json=v2_body(["a"]))
        assert r.status_code == 503 and r.json()["code"] == "model_not_ready"
        assert client.get("/v2/health/live").status_code == 200  # the process still lives
