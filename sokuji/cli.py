"""``sokuji``: one entry point.

  sokuji serve [--config FILE] [--host H] [--port P] [--cache-dir DIR] [--log-level L]
  sokuji serve --ray [--ray-address ADDR] [--replicas N] [...]   on Ray Serve (extra ray)
  sokuji export minilm|mpnet [--cache-dir DIR]   build the ONNX file of a built-in model now
  sokuji export DIR [--out OUT] [--task T] [--triton]   a local Hugging Face checkpoint as a
                                              served ONNX model, checked (docs/export.md)
  sokuji models [--config FILE]               list the configured models
  sokuji bench URL (--concurrency N | --rate R) [...]   load generator (sokuji bench -h)
  sokuji bench compare A.json B.json [--threshold 10%]
  sokuji optimize MODEL [...]                 variants measured, gated and recorded
  sokuji plan --from BENCH.json [...] --rate R --slo p99=100ms   replicas, cost, memory
  sokuji index build|info [--cache-dir DIR]   the retrieval index (pydoc topics)
  sokuji callback-secret TENANT [--config FILE]   the key a tenant's callback receiver checks
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from sokuji import config as cfg
from sokuji.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sokuji", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the configured models over HTTP")
    serve.add_argument("--config", help="TOML file (default: $SOKUJI_CONFIG or built-in)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--cache-dir", dest="cache_dir")
    serve.add_argument("--log-level", dest="log_level")
    serve.add_argument("--model-repository", dest="model_repository",
                       help="serve every model of this Triton model repository")
    serve.add_argument("--ray", action="store_true",
                       help="run on Ray Serve: replicas of the whole server ([ray] table)")
    serve.add_argument("--ray-address", dest="ray_address",
                       help="join this Ray cluster (auto, host:port); default [ray] address, "
                       "else a local cluster")
    serve.add_argument("--replicas", type=int, help="[ray] replicas")

    export = sub.add_parser("export", help="export a built-in model, or a local Hugging Face "
                            "checkpoint directory, to ONNX (docs/export.md)")
    export.add_argument("model", help="minilm, mpnet, or a checkpoint directory (./minilm for "
                        "a directory of that name)")
    export.add_argument("--cache-dir", dest="cache_dir")
    export.add_argument("--out", help="output directory (default: under the cache dir)")
    export.add_argument("--task", choices=["embedding", "classification"],
                        help="force the layout (default: read from the files)")
    export.add_argument("--name", help="the model's name in the printed entry (default: the "
                        "directory's)")
    export.add_argument("--max-length", dest="max_length", type=int,
                        help="tokens the model reads (default: the checkpoint's)")
    export.add_argument("--triton", action="store_true",
                        help="also write <out>/<name>/config.pbtxt + 1/model.onnx")
    export.add_argument("--max-batch-size", dest="max_batch_size", type=int, default=32,
                        help="the Triton config's max_batch_size (default 32)")

    models = sub.add_parser("models", help="list the configured models")
    models.add_argument("--config")
    secret = sub.add_parser("callback-secret", help="print the key that signs TENANT's job "
                            "callbacks (for keys without their own callback_secret)")
    secret.add_argument("tenant")
    secret.add_argument("--config")
    sub.add_parser("bench", help="load generator: sokuji bench -h", add_help=False)
    sub.add_parser("optimize", help="build, measure and gate model variants: sokuji "
                   "optimize -h", add_help=False)
    sub.add_parser("plan", help="replicas, cores, cost and memory from bench results: sokuji "
                   "plan -h", add_help=False)  # --- capacity planner (issue 16) ---
    # --- retrieval index (issue 13): sokuji/retrieval/cli.py ---
    sub.add_parser("index", help="build / inspect the retrieval index: sokuji index -h",
                   add_help=False)
    sub.add_parser("route", help="fit a cascade router's threshold: sokuji route calibrate -h",
                   add_help=False)
    sub.add_parser("cache", help="fit a semantic cache's threshold: sokuji cache calibrate -h",
                   add_help=False)
    return p


BUILTIN_EXPORTS = (cfg.DEFAULT_MODEL_NAME, "mpnet")


def _export(args: argparse.Namespace) -> int:
    """A built-in name alone: its cached ONNX file (built if missing), as ever. A directory
    (or a built-in name with --out/--task/--triton: its checkpoint): ``hf_export.run``."""
    from pathlib import Path

    config = cfg.load(overrides={"cache_dir": args.cache_dir})
    general = (args.out, args.task, args.triton, args.name, args.max_length)
    source: str | Path = args.model
    if args.model in BUILTIN_EXPORTS:
        from sokuji.weights import minilm, mpnet

        if not any(general):
            print(minilm.ensure_onnx(config.cache_dir) if args.model == cfg.DEFAULT_MODEL_NAME
                  else mpnet.ensure_onnx(config.cache_dir))
            return 0
        source = (minilm.package_model_dir() if args.model == cfg.DEFAULT_MODEL_NAME
                  else mpnet.ensure_dir(config.cache_dir))
    from sokuji.weights import hf_export

    return hf_export.run(source, out=Path(args.out) if args.out else None,
                         cache_dir=config.cache_dir, task=args.task,
                         name=args.name or (args.model if args.model in BUILTIN_EXPORTS
                                            else None),
                         triton=args.triton, max_length=args.max_length,
                         max_batch_size=args.max_batch_size)


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    from types import FrameType

    import uvicorn

    from sokuji.observability.metrics import Metrics
    from sokuji.repository.models import ModelRepository
    from sokuji.server.app import create_app

    config = cfg.load(args.config, overrides={
        "host": args.host, "port": args.port, "cache_dir": args.cache_dir,
        "log_level": args.log_level, "model_repository": args.model_repository})
    if args.ray or args.ray_address or args.replicas:
        return _serve_ray(config, args)
    logging.basicConfig(level=config.log_level.upper() if config.log_level != "trace"
                        else "DEBUG", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = Metrics()
    repo = ModelRepository.load(config, on_batch=metrics.batch_observer)
    app = create_app(config, repo, metrics, grpc=True)
    import gc

    # What start-up built (models, tokenizers, imported modules: millions of objects) never
    # becomes garbage: out of the collector's generations, a full collection no longer walks
    # it (one was seen to hold the loop 66 ms under load, a p99 spike; benchmarks/
    # python_serving.py). Requests' own objects are collected as before.
    gc.collect()
    gc.freeze()

    class Server(uvicorn.Server):
        """SIGTERM: readiness false first, drain, then uvicorn's graceful shutdown (stop
        accepting, finish in-flight requests within the grace period, stop the models)."""

        draining = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.draining or sig != signal.SIGTERM or config.shutdown_drain_s <= 0:
                repo.mark_unready()
                super().handle_exit(sig, frame)
                return
            self.draining = True
            repo.mark_unready()
            logging.getLogger("sokuji").info(
                "SIGTERM: not ready; closing the listener in %.1f s", config.shutdown_drain_s)
            asyncio.get_running_loop().call_later(config.shutdown_drain_s,
                                                  super().handle_exit, sig, frame)

    server = Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, loop="uvloop",
        http="httptools", access_log=False, server_header=False, date_header=False,
        proxy_headers=False, timeout_graceful_shutdown=int(config.shutdown_grace_s) or None))
    server.run()
    return 0


def _serve_ray(config: cfg.ServerConfig, args: argparse.Namespace) -> int:
    """``sokuji serve --ray`` (``sokuji/scale/launcher.py``)."""
    import msgspec

    if args.replicas is not None:
        if args.replicas < 1:
            raise ConfigError("--replicas must be >= 1")
        config = cfg.validate(msgspec.structs.replace(
            config, ray=msgspec.structs.replace(config.ray, replicas=args.replicas)))
    logging.basicConfig(level=config.log_level.upper() if config.log_level != "trace"
                        else "DEBUG", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from sokuji.scale.launcher import serve_on_ray
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Serve: pip install 'sokuji[ray]' ({exc})") from None
    return serve_on_ray(config, args.ray_address)


def _callback_secret(tenant: str, config_path: str | None) -> int:
    """Print ``tenant``'s derived callback signing key (what its receiver verifies with);
    notes on stderr when some of its keys sign with their own ``callback_secret``."""
    from sokuji.server.callback_delivery import default_secret, tenant_secret

    config = cfg.load(config_path)
    keys = [k for k in config.api_keys if k.tenant == tenant]
    if config.api_keys and not keys:
        print(f"sokuji: note: no API key in the config belongs to tenant '{tenant}'",
              file=sys.stderr)
    own = sum(1 for k in keys if k.callback_secret)
    if own:
        print(f"sokuji: note: {own} of the {len(keys)} key(s) of tenant '{tenant}' sign with "
              "their own callback_secret; this key is for the others", file=sys.stderr)
    print(tenant_secret(default_secret(config), tenant))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["optimize"]:
        from sokuji.optimize.cli import main as main_optimize

        return main_optimize(argv[1:])
    if argv[:1] == ["plan"]:  # --- capacity planner (issue 16): sokuji/plan/cli.py ---
        from sokuji.plan.cli import main as main_plan

        return main_plan(argv[1:])
    if argv[:1] == ["index"]:  # --- retrieval index (issue 13) ---
        from sokuji.retrieval.cli import main as main_index

        return main_index(argv[1:])
    if argv[:2] in (["route", "calibrate"], ["cache", "calibrate"]):
        try:
            if argv[0] == "route":
                from sokuji.routing.calibrate import main as main_route

                return main_route(argv[2:])
            from sokuji.routing.cache_calibrate import main as main_cache

            return main_cache(argv[2:])
        except ConfigError as exc:
            print(f"sokuji: {exc.message}", file=sys.stderr)
            return 2
    if argv[:1] == ["bench"]:
        from sokuji.bench.runner import main_bench  # a client: never imports the server

        return main_bench(argv)
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "export":
            return _export(args)
        if args.command == "models":
            for m in cfg.load(args.config).models:
                print(f"{m.name}\truntime={m.runtime}\tversion={m.version}\t"
                      f"max_batch_size={m.max_batch_size}\tbatching={m.batching.value}")
            return 0
        if args.command == "callback-secret":
            return _callback_secret(args.tenant, args.config)
    except ConfigError as exc:
        print(f"sokuji: {exc.message}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
