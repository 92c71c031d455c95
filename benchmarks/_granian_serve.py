"""Sokuji's ASGI app under granian (a Rust HTTP server: hyper + tokio) instead of uvicorn, for
``tensor_serving.py``'s HTTP-front comparison.

The app is built exactly as ``sokuji serve`` builds it (``cli._serve``: the config, the model
repository, ``create_app``) and the same object is handed to granian's embedded server, which
runs it on this process's asyncio loop (uvloop, as under uvicorn) with one Rust runtime
thread; the lifespan (batchers' start and stop) runs as under uvicorn. Nothing else differs.

    python _granian_serve.py --config FILE
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import uvloop


def main() -> None:
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    from sokuji import config as cfg
    from sokuji.observability.metrics import Metrics
    from sokuji.repository.models import ModelRepository
    from sokuji.server.app import create_app

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    args = p.parse_args()
    config = cfg.load(args.config)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = Metrics()
    repo = ModelRepository.load(config, on_batch=metrics.batch_observer)
    app = create_app(config, repo, metrics)
    server = Server(app, address=config.host, port=config.port, interface=Interfaces.ASGI,
                    runtime_threads=1, http=HTTPModes.http1, log_access=False,
                    log_enabled=False, websockets=False)

    async def serve() -> None:
        await server.serve()

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve())


if __name__ == "__main__":
    main()
