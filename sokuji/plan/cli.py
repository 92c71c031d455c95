"""``sokuji plan``: replicas, cores, cost, memory and the variant to serve, from bench results.

    sokuji plan --from c1.json c4.json c48.json open.json --stats http://127.0.0.1:8000 \\
        --rate 2000 --slo p99=100ms --price-per-hour 0.4 --html plan.html
    sokuji plan --from c1.json c4.json c48.json open.json --predict 200   (one replica)
    sokuji plan --from chat-c*.json --rate 20 --slo ttft_p99=500ms --slo itl_p99=50ms \\
        --gguf model.gguf

Encoders: bench one replica with ``--concurrency 1`` (a lone request), ``4`` and about
``1.5 x max_batch_size`` (capacity), and an open loop (``--rate``) at about half the
capacity (the time outside the server under load); ``--stats`` reads the batcher's settings
from the server.

An encoder is fitted (``fit.py``) and simulated (``simulate.py``); a generator is read off its
streaming runs (``generator.py``). Exit codes: 0 a plan was made, 2 bad input, 3 no number of
replicas meets the SLO. ``--json`` writes the result (schema ``sokuji.plan/1``), ``--html`` a
report with plots.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sokuji.bench import scrub
from sokuji.bench.stats import Slo, parse_slo
from sokuji.errors import ConfigError
from sokuji.plan import fit as fitting
from sokuji.plan import generator, inputs, memory, planner
from sokuji.plan.fit import Sim

SCHEMA = "sokuji.plan/1"


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _count(text: str) -> int:
    value = _positive(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text}")
    return int(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sokuji plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="sources", nargs="+", action="extend", required=True,
                   metavar="BENCH_JSON", help="sokuji bench results (--out) of one model: "
                   "closed loops at concurrency 1, 4 and past a batch, an open loop at about "
                   "half the capacity (encoders); streaming runs (generators)")
    p.add_argument("--rate", type=_positive, help="requests a second the service must take")
    p.add_argument("--slo", action="append", default=[],
                   help="p99=100ms, mean=20ms, ttft_p99=500ms, itl_p99=50ms, error_rate=1%%")
    p.add_argument("--price-per-hour", type=_positive,
                   help="price of one replica (the server benched) per hour")
    p.add_argument("--cores-per-replica", type=_count, default=1,
                   help="cores the benched server had (default 1)")
    p.add_argument("--max-replicas", type=_count, default=10_000)
    p.add_argument("--predict", type=_positive, action="append", default=[], metavar="RATE",
                   help="also predict one replica at RATE req/s (repeatable)")
    p.add_argument("--stats", help="the server (http://host:port) or a saved /config or "
                   "/stats reply: max_batch_size, queue bound, batch sizes")
    p.add_argument("--header", action="append", default=[], help="for --stats URL: K:V")
    p.add_argument("--max-batch-size", type=_count)
    p.add_argument("--max-queue-depth", type=_count)
    p.add_argument("--variants", help="sokuji optimize's index.json (or its directory)")
    p.add_argument("--served-variant", default="fp32",
                   help="the variant the bench runs measured (default fp32)")
    p.add_argument("--model-file", help="the encoder's ONNX file (its size: the weights)")
    p.add_argument("--gguf", help="a generator's GGUF (weights; KV cache from its metadata)")
    p.add_argument("--slots", type=_count, help="generator slots (default: the runtime's)")
    p.add_argument("--context-size", type=_count, help="KV cells per slot")
    p.add_argument("--kv-type", default="f16", choices=sorted(memory.KV_TYPE_BYTES))
    p.add_argument("--rss-mb", type=_positive, help="one replica's measured resident memory")
    p.add_argument("--sim-seconds", type=_positive, default=60.0,
                   help="simulated seconds per load and seed (at least)")
    p.add_argument("--seeds", type=_count, default=4, help="schedules per simulated load")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--html", help="write an HTML report with plots here")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")
    return p


def _slos(texts: list[str]) -> tuple[Slo, ...]:
    out = []
    for text in texts:
        try:
            out.append(parse_slo(text))
        except ValueError as exc:
            raise ConfigError(str(exc), param="--slo") from None
    return tuple(out)


def _headers(raw: list[str]) -> dict[str, str]:
    out = {}
    for i, h in enumerate(raw, 1):
        key, sep, value = h.partition(":")
        if not sep:  # the text is not echoed: it may be a credential
            raise ConfigError(f"--header number {i} has no ':'; expected Name: value")
        out[key.strip()] = value.strip()
    return out


def _runs(sources: list[str]) -> list[inputs.Run]:
    runs = [r for s in sources for r in inputs.load_bench(s)]
    models = sorted({r.model for r in runs})
    if len(models) > 1:
        raise ConfigError(f"the results measured several models ({', '.join(models)}): "
                          "plan one model at a time")
    if len({r.streaming for r in runs}) > 1:
        raise ConfigError("the results mix streaming (generation) and non-streaming runs")
    return runs


def build(args: argparse.Namespace, argv: Sequence[str],
          progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The plan as a ``sokuji.plan/1`` document."""
    if args.rate is None and not args.predict:
        raise ConfigError("nothing to plan: give --rate (with --slo) or --predict")
    slos = _slos(args.slo)
    if args.rate is not None and not any(s.metric != "error_rate" for s in slos):
        raise ConfigError("--rate needs a latency SLO, e.g. --slo p99=100ms")
    runs = _runs(args.sources)
    goal = planner.Goal(rate=args.rate, slos=slos, price_per_hour=args.price_per_hour,
                        cores_per_replica=args.cores_per_replica,
                        max_replicas=args.max_replicas)
    rss = int(args.rss_mb * memory.MIB) if args.rss_mb else \
        next((r.rss_bytes for r in runs if r.rss_bytes), None)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": ["sokuji", *(scrub.arg(a) for a in argv)], "inputs": [r.label for r in runs],
        "model": runs[0].model,
        "goal": {"rate": args.rate, "slos": [s.text for s in slos],
                 "price_per_replica_hour": args.price_per_hour,
                 "cores_per_replica": args.cores_per_replica}}
    if runs[0].streaming:
        return _generator(doc, args, runs, goal, rss)
    for slo in slos:
        if slo.metric not in ("latency_ms", "error_rate"):
            raise ConfigError(f"SLO {slo.text!r} is for generators (streaming runs); an "
                              "encoder's SLOs: p99=100ms, mean=20ms, error_rate=1%",
                              param="--slo")
    server = inputs.load_stats(args.stats, runs[0].model, _headers(args.header)) \
        if args.stats else None
    sim = Sim(seconds=args.sim_seconds, seeds=args.seeds)
    fit = fitting.fit_encoder(runs, server, max_batch=args.max_batch_size,
                              queue_depth=args.max_queue_depth, sim=sim, progress=progress)
    doc["kind"] = "encoder"
    doc["fit"] = fit.as_dict()
    if server is not None:
        doc["server"] = {"source": scrub.url(server.source),
                         "mean_batch_since_start": server.mean_batch,
                         "batch_counts": server.batch_counts}
    progress("checking the fit against the inputs")
    doc["fit_check"] = fitting.check(fit, runs, sim)
    doc["predictions"] = [planner.predict(fit, r, sim).as_dict() for r in args.predict]
    if args.rate is not None:
        doc["plan"] = planner.encoder_plan(fit, goal, sim, progress)
        if doc["plan"]["replicas"] is not None:
            doc["curves"] = planner.curves(fit, goal, doc["plan"], sim, progress)
    index = planner.read_index(args.variants) if args.variants else None
    weights = Path(args.model_file).stat().st_size if args.model_file else None
    if index is not None:
        served = index["variants"].get(args.served_variant) or {}
        weights = weights or served.get("bytes")
        doc["variants"], doc["recommended_variant"] = planner.variant_plans(
            fit, goal, sim, index, args.served_variant, rss, progress)
    doc["memory"] = memory.breakdown(weights, None, rss)
    _per_plan_memory(doc)
    doc["notes"] = list(fit.notes)
    return doc


def _generator(doc: dict[str, Any], args: argparse.Namespace, runs: list[inputs.Run],
               goal: planner.Goal, rss: int | None) -> dict[str, Any]:
    doc["kind"] = "generator"
    if args.predict:
        raise ConfigError("--predict simulates encoders; a generator's plan reads its runs")
    doc["plan"] = generator.generator_plan(runs, goal)
    weights = kv = None
    bounds = None
    if args.gguf:
        from sokuji.llm.options import LlamaOptions  # light: llama.cpp is not imported

        defaults = LlamaOptions()
        path = Path(args.gguf)
        shape = memory.KvShape.from_metadata(memory.gguf_metadata(path), str(path))
        slots = args.slots or defaults.slots
        context = args.context_size or defaults.context_size
        weights = path.stat().st_size
        kv = memory.kv_cache_bytes(shape, slots, context, args.kv_type)
        bounds = {"prefix_cache_bytes": defaults.prefix_cache_mb * memory.MIB}
        doc["kv_shape"] = {"architecture": shape.architecture, "n_layer": shape.n_layer,
                           "n_head_kv": shape.n_head_kv, "head_dim": shape.head_dim_k,
                           "slots": slots, "context_size": context, "type": args.kv_type,
                           "bytes_per_token": shape.bytes_per_cell(args.kv_type)}
    doc["memory"] = memory.breakdown(weights, kv, rss, bounds)
    _per_plan_memory(doc)
    doc["notes"] = doc["plan"].pop("notes")
    return doc


def _per_plan_memory(doc: dict[str, Any]) -> None:
    n = (doc.get("plan") or {}).get("replicas")
    total = doc["memory"].get("total_bytes")
    if n and total:
        doc["memory"]["all_replicas_bytes"] = n * total


def main(argv: Sequence[str] | None = None) -> int:
    """Entry from ``sokuji plan ...`` (``argv`` excludes ``plan``)."""
    from rich.console import Console

    from sokuji.plan import report

    argv = list(sys.argv[2:] if argv is None else argv)
    if argv[:1] == ["--ray"]:  # the 1-100 replica model on Ray Serve (plan/scaleout.py)
        from sokuji.plan import scaleout

        return scaleout.main(argv[1:])
    args = parser().parse_args(argv)
    err = Console(stderr=True)
    try:
        with report.progress_bar(err, args.quiet) as step:
            doc = build(args, ["plan", *argv], step)
        if not args.quiet:
            report.print_plan(Console(), doc)
        if args.json_out:
            report.write_json(args.json_out, doc)
        if args.html:
            report.write_html(args.html, doc)
    except ConfigError as exc:
        print(f"sokuji plan: {exc.message}", file=sys.stderr)
        return 2
    plan = doc.get("plan")
    if plan is not None and plan.get("replicas") is None:
        print(f"sokuji plan: {plan.get('reason', 'no plan meets the SLO')}", file=sys.stderr)
        return 3
    return 0
