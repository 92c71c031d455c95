"""The structured-output parts of benchmarks/llm_serving.py (issue 28): constrained load
(a bounded JSON schema at 1 and 8 streams, against the same prompts unconstrained with
matched lengths), TTFT with a schema compiled cold and cached, and logprobs' cost per token.

The schema bounds every answer (strings with maxLength, an enum, integers with both bounds,
an array with maxItems: docs/structured-outputs.md's "unbounded numbers" caveat), so each
constrained answer ends by itself well under ``--schema-max-tokens``; every one is checked
with ``jsonschema`` and the invalid ones are counted and kept (an answer cut off at
max_tokens, finish ``length``, is invalid too).

Sokuji gets OpenAI's ``response_format`` (json_schema, strict) on ``/v1/completions``;
llama-server its native ``json_schema`` field on the same route (``tools/server/
server-schema.cpp``: converted to GBNF per request, ``json_schema_to_grammar``). Without
ignore_eos the answers end where the document does, and each server's whitespace differs
(Sokuji's JSON is compact; llama.cpp's grammar allows spaces and newlines), so the figure is
the rate (usage completion tokens / wall time), not a request count. The unconstrained
baseline ("plain") replays each constrained request with the same prompt, ``max_tokens``
equal to the tokens that answer took and ``ignore_eos``: the same work without the grammar.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import jsonschema
from _harness import percentile
from _llm_load import SYSTEM, TOPICS, itls, session_, turn_tokens

from sokuji.bench import sse

SK, LS = "sokuji", "llama-server"

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["title", "hero", "age", "place", "mood", "events", "rating"],
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 40},
        "hero": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 1, "maximum": 120},
        "place": {"type": "string", "minLength": 1, "maxLength": 40},
        "mood": {"enum": ["happy", "sad", "tense", "calm", "funny"]},
        "events": {"type": "array", "minItems": 1, "maxItems": 3,
                   "items": {"type": "string", "minLength": 1, "maxLength": 50}},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10}}}
"""At most ~430 characters of content: every answer ends by itself (~60-150 tokens)."""


def unique_schema(i: int) -> dict[str, Any]:
    """The schema with one property renamed: a schema neither server has seen (cold)."""
    s = copy.deepcopy(SCHEMA)
    key = f"title_{i}"
    s["properties"] = {key: s["properties"].pop("title"), **s["properties"]}
    s["required"] = [key, *s["required"][1:]]
    return s


def json_prompt(nonce: int, topic: str, fresh: bool = False, replay: bool = False) -> str:
    """A chat turn asking for the schema's document (``fresh``: starts with the number's
    digits reversed, so no prefix cache helps). A ``replay`` starts its user turn with
    "Now": it shares only the system prompt with its original (a number or tag first made
    SmolLM2 copy it into every string: answers 2.7x longer)."""
    head = f"{str(nonce)[::-1]} " if fresh else ""
    return (f"{head}<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
            f"{'Now summarise' if replay else 'Summarise'} a short story about {topic} "
            f"(story {nonce}) as a JSON object with a "
            "title, the hero's name and age, the place, the mood, up to three events and a "
            "rating from 1 to 10.<|im_end|>\n<|im_start|>assistant\n")


def chat_messages(nonce: int, topic: str, replay: bool = False) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{'Now write' if replay else 'Write'} a long story "
                                        f"about {topic} (story {nonce})."}]


def constraint(server: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The request fields that ask ``server`` for ``schema``, each server's own way."""
    if server == SK:
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "story", "schema": schema, "strict": True}}}
    return {"json_schema": schema}


@dataclass
class Reply:
    times: list[float]
    """Seconds from sending to each non-empty chunk."""
    tokens: int
    """The usage's completion tokens (non-empty chunks where there is no usage)."""
    text: str
    finish: str | None
    nonce: int = 0
    turn: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 name: str) -> Reply:
    """One streamed request (completions or chat), timed chunk by chunk."""
    body = {"temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **body}
    t0 = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    usage: int | None = None
    finish: str | None = None
    accepted = rejected = 0
    async with session.post(url, json=body) as r:
        assert r.status == 200, f"{name}: {r.status} {await r.text()}"
        async for line in r.content:
            doc = sse.data(line)
            if doc is None:
                continue
            for piece in sse.pieces(doc):
                times.append(time.perf_counter() - t0)
                parts.append(piece)
            for choice in doc.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            if sse.completion_tokens(doc) is not None:
                usage = sse.completion_tokens(doc)
                details = doc["usage"].get("completion_tokens_details") or {}
                accepted = details.get("accepted_prediction_tokens") or 0
                rejected = details.get("rejected_prediction_tokens") or 0
    return Reply(times, len(times) if usage is None else usage, "".join(parts), finish,
                 extra={"accepted": accepted, "rejected": rejected})


class Validator:
    def __init__(self) -> None:
        self.checkers: dict[str, jsonschema.protocols.Validator] = {}

    def invalid(self, text: str, schema: dict[str, Any]) -> str | None:
        """Why ``text`` is not a valid document of ``schema`` (None: it is)."""
        key = json.dumps(schema, sort_keys=True)
        if key not in self.checkers:
            cls = jsonschema.validators.validator_for(schema)
            self.checkers[key] = cls(schema)
        try:
            doc = json.loads(text)
        except ValueError as e:
            return f"not JSON: {e}"
        err = jsonschema.exceptions.best_match(self.checkers[key].iter_errors(doc))
        return None if err is None else err.message


VALIDATOR = Validator()


def summarize(name: str, runs: list[tuple[float, list[Reply]]], validate: bool
              ) -> dict[str, Any]:
    """Pooled over runs (each: its wall time, its replies)."""
    replies = [x for _, rs in runs for x in rs]
    tokens = sum(x.tokens for x in replies)
    wall = sum(w for w, _ in runs)
    ttft = [x.times[0] * 1e3 for x in replies if x.times and x.turn > 0]
    start = [x.times[0] * 1e3 for x in replies if x.times and x.turn == 0]
    itl = [g * 1e3 for x in replies for g in itls(x.times)]
    finishes: dict[str, int] = {}
    for x in replies:
        finishes[str(x.finish)] = finishes.get(str(x.finish), 0) + 1
    out: dict[str, Any] = {
        "tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
        "requests": len(replies), "tokens_per_answer_mean": tokens / len(replies),
        "tokens_per_answer_max": max(x.tokens for x in replies),
        "runs_tokens_per_s": [sum(x.tokens for x in rs) / w for w, rs in runs],
        "finish_reasons": finishes,
        "ttft_p50_ms": statistics.median(ttft or start), "ttft_p99_ms":
            percentile(ttft or start, 99), "ttft_max_ms": max(ttft or start),
        "ttft_start_p50_ms": statistics.median(start), "ttft_start_max_ms": max(start),
        "itl_p50_ms": statistics.median(itl), "itl_p99_ms": percentile(itl, 99),
        "itl_mean_ms": statistics.fmean(itl), "answers_per_s": len(replies) / wall,
        # Sokuji's speculative decoding (n-gram, on by default): draft tokens accepted and
        # rejected, from usage.completion_tokens_details (llama-server reports none)
        "spec_accepted": sum(x.extra.get("accepted", 0) for x in replies),
        "spec_rejected": sum(x.extra.get("rejected", 0) for x in replies),
        "ttft_ms": ttft, "ttft_start_ms": start}
    if validate:
        bad = [(x, VALIDATOR.invalid(x.text, SCHEMA)) for x in replies]
        bad = [(x, why) for x, why in bad if why is not None]
        out["invalid"] = len(bad)
        out["invalid_examples"] = [{"nonce": x.nonce, "finish": x.finish, "why": why,
                                    "text": x.text[:600]} for x, why in bad[:5]]
        out["example"] = replies[0].text
    print(f"    {name:24s} {out['tokens_per_s']:6.1f} tok/s, {len(replies)} answers "
          f"({out['tokens_per_answer_mean']:.0f} tokens mean), TTFT p50 "
          f"{out['ttft_p50_ms']:.0f} ms, ITL p50 {out['itl_p50_ms']:.1f} ms, drafts accepted "
          f"{out['spec_accepted']} / {out['spec_accepted'] + out['spec_rejected']}"
          + (f", invalid {out['invalid']}" if validate else ""), flush=True)
    return out


async def closed_loop(streams: int, turns: int, make: Any) -> tuple[float, list[Reply]]:
    """``streams`` workers, each ``turns`` requests one after the other; ``make(w, r)`` is
    an awaitable giving a Reply."""
    replies: list[Reply] = []
    async def worker(w: int) -> None:
        for r in range(turns):
            replies.append(await make(w, r))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(streams)))
    return time.perf_counter() - t0, replies


async def schema_level(args: argparse.Namespace, ports: dict[str, int], streams: int
                       ) -> dict[str, Any]:
    """Constrained load at ``streams`` streams on both servers, then each server's plain
    replay of its own answers' lengths (ignore_eos); contestants alternate round by round,
    the same prompts for all in a round."""
    names = [SK, LS]
    runs: dict[str, list[tuple[float, list[Reply]]]] = {
        f"{n}{v}": [] for n in names for v in ("", " plain")}
    async with session_() as session:
        for rnd in range(args.rounds):
            base = 7_000_000 + 100_000 * streams + 1000 * rnd
            order = names if rnd % 2 == 0 else names[::-1]
            lengths: dict[str, dict[int, int]] = {}
            for name in order:
                url = f"http://127.0.0.1:{ports[name]}/v1/completions"

                async def json_req(w: int, r: int, name: str = name, url: str = url,
                                   base: int = base) -> Reply:
                    n = base + w * args.turns + r
                    body = {"model": "smollm2", "prompt": json_prompt(n, TOPICS[n % 12]),
                            "max_tokens": args.schema_max_tokens, **constraint(name, SCHEMA)}
                    x = await stream(session, url, body, name)
                    x.nonce, x.turn = n, r
                    return x
                wall, rs = await closed_loop(streams, args.turns, json_req)
                runs[name].append((wall, rs))
                lengths[name] = {x.nonce: x.tokens for x in rs}
            for name in order:
                url = f"http://127.0.0.1:{ports[name]}/v1/completions"

                async def plain_req(w: int, r: int, name: str = name, url: str = url,
                                    base: int = base,
                                    lengths: dict[str, dict[int, int]] = lengths) -> Reply:
                    n = base + w * args.turns + r
                    # another tag: the constrained run's prompt is in this server's prefix
                    # cache now (the same topic and length; only the system prompt shared)
                    body = {"model": "smollm2",
                            "prompt": json_prompt(n, TOPICS[n % 12], replay=True),
                            "max_tokens": max(1, lengths[name][n]), "ignore_eos": True}
                    x = await stream(session, url, body, name)
                    x.nonce, x.turn = n, r
                    return x
                runs[f"{name} plain"].append(await closed_loop(streams, args.turns, plain_req))
    out = {k: summarize(f"{k} ({streams} streams)", v, validate=not k.endswith("plain"))
           for k, v in runs.items()}
    out["ratios"] = {
        "json_sokuji_over_llama_server": out[SK]["tokens_per_s"] / out[LS]["tokens_per_s"],
        "sokuji_json_over_plain": out[SK]["tokens_per_s"] / out[f"{SK} plain"]["tokens_per_s"],
        "llama_server_json_over_plain":
            out[LS]["tokens_per_s"] / out[f"{LS} plain"]["tokens_per_s"],
        "json_sokuji_over_llama_server_runs": [
            a[1] / b[1] for a, b in zip(
                [(0, sum(x.tokens for x in rs) / w) for w, rs in runs[SK]],
                [(0, sum(x.tokens for x in rs) / w) for w, rs in runs[LS]], strict=True)],
        "ttft_p50_sokuji_over_llama_server": out[SK]["ttft_p50_ms"] / out[LS]["ttft_p50_ms"],
        "ttft_p99_sokuji_over_llama_server": out[SK]["ttft_p99_ms"] / out[LS]["ttft_p99_ms"]}
    return out


async def compile_ttft(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, Any]:
    """TTFT, one request at a time: a schema never seen (cold: compiled in the request's
    TTFT), the warm schema again (cached), and no schema; fresh prompts throughout (no prefix
    cache), servers and variants in a rotating order."""
    names = [SK, LS]
    variants = ["cold", "cached", "none"]
    got: dict[str, dict[str, list[float]]] = {n: {v: [] for v in variants} for n in names}
    async with session_() as session:
        for i in range(args.compile_samples):
            k = i % 2
            for name in names[k:] + names[:k]:
                url = f"http://127.0.0.1:{ports[name]}/v1/completions"
                j = i % 3
                for v in variants[j:] + variants[:j]:
                    n = 90_000 + 10 * i + variants.index(v)
                    schema = unique_schema(n) if v == "cold" else SCHEMA
                    body = {"model": "smollm2", "max_tokens": args.compile_tokens,
                            "prompt": json_prompt(n, TOPICS[n % 12], fresh=True),
                            **(constraint(name, schema) if v != "none" else {})}
                    x = await stream(session, url, body, name)
                    got[name][v].append(x.times[0] * 1e3)
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {f"{v}_ttft_ms": got[name][v] for v in variants}
        for v in variants:
            out[name][f"{v}_p50_ms"] = statistics.median(got[name][v])
            out[name][f"{v}_p99_ms"] = percentile(got[name][v], 99)
        out[name]["cold_minus_none_paired_p50_ms"] = statistics.median(
            a - b for a, b in zip(got[name]["cold"], got[name]["none"], strict=True))
        out[name]["cached_minus_none_paired_p50_ms"] = statistics.median(
            a - b for a, b in zip(got[name]["cached"], got[name]["none"], strict=True))
    for v in variants:
        out[f"{v}_p50_sokuji_over_llama_server"] = (out[SK][f"{v}_p50_ms"]
                                                    / out[LS][f"{v}_p50_ms"])
    return out


async def logprobs_cost(args: argparse.Namespace, port: int) -> dict[str, Any]:
    """Sokuji's chat route with ``logprobs: true, top_logprobs: 5`` against without, at each
    of ``--logprobs-streams`` streams, ignore_eos, the same lengths (``turn_tokens``: the
    first turn ramped, later ones spread) and prompts for both, alternating run by run."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    variants = {"plain": {}, "logprobs": {"logprobs": True, "top_logprobs": 5}}
    out: dict[str, Any] = {}
    async with session_() as session:
        for streams in args.logprobs_streams:
            runs: dict[str, list[tuple[float, list[Reply]]]] = {v: [] for v in variants}
            for rnd in range(args.rounds):
                base = 8_000_000 + 100_000 * streams + 1000 * rnd
                order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
                for v in order:
                    async def req(w: int, r: int, v: str = v, base: int = base,
                                  streams: int = streams, rnd: int = rnd) -> Reply:
                        n = base + w * args.turns + r
                        # the second variant's prompt differs after the system prompt (no
                        # prefix-cache hit); which one says "Now" alternates round by round
                        replay = (list(variants).index(v) + rnd) % 2 == 1
                        body = {"model": "smollm2",
                                "messages": chat_messages(n, TOPICS[n % 12], replay),
                                "max_tokens": turn_tokens(args, n, w, streams, r),
                                "ignore_eos": True, **variants[v]}
                        x = await stream(session, url, body, SK)
                        x.nonce, x.turn = n, r
                        return x
                    runs[v].append(await closed_loop(streams, args.turns, req))
            level = {v: summarize(f"{v} ({streams} streams)", rs, validate=False)
                     for v, rs in runs.items()}
            p, lp = level["plain"], level["logprobs"]
            level["tokens_per_s_ratio"] = lp["tokens_per_s"] / p["tokens_per_s"]
            level["ms_per_token_added"] = 1e3 / lp["tokens_per_s"] - 1e3 / p["tokens_per_s"]
            level["itl_p50_added_ms"] = lp["itl_p50_ms"] - p["itl_p50_ms"]
            level["itl_mean_added_ms"] = lp["itl_mean_ms"] - p["itl_mean_ms"]
            out[str(streams)] = level
    return out


async def run_parts(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, Any]:
    result: dict[str, Any] = {"schema": SCHEMA}
    async with session_() as session:  # warm: both servers compile SCHEMA once
        for name in (SK, LS):
            url = f"http://127.0.0.1:{ports[name]}/v1/completions"
            x = await stream(session, url, {"model": "smollm2", "prompt": json_prompt(
                1, "warmup"), "max_tokens": args.schema_max_tokens,
                **constraint(name, SCHEMA)}, name)
            print(f"  warm-up, {name}: {x.tokens} tokens, finish {x.finish}: {x.text}",
                  flush=True)
    if "schema" in args.parts:
        result["load"] = {}
        for n in args.schema_streams:
            print(f"structured load: {n} streams x {args.turns} turns, {args.rounds} rounds "
                  "(json, then plain with matched lengths) ...", flush=True)
            result["load"][str(n)] = await schema_level(args, ports, n)
    if "compile" in args.parts:
        print(f"schema compile TTFT: {args.compile_samples} samples ...", flush=True)
        result["compile"] = await compile_ttft(args, ports)
    if "logprobs" in args.parts:
        print("logprobs cost (Sokuji, chat) ...", flush=True)
        result["logprobs"] = await logprobs_cost(args, ports[SK])
    return result


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    if "load" in result:
        print(f"\nstructured load (bounded JSON schema; plain = same prompts, matched lengths,"
              f" ignore_eos), pooled over {args.rounds} rounds:")
        print(f"{'streams':>7} {'contestant':20s} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} "
              f"{'ITL p50':>8} {'p99':>6} {'tok/ans':>7} {'invalid':>8}")
        for n in args.schema_streams:
            level = result["load"][str(n)]
            for name in (SK, LS, f"{SK} plain", f"{LS} plain"):
                r = level[name]
                inv = f"{r['invalid']}/{r['requests']}" if "invalid" in r else ""
                print(f"{n:7d} {name:20s} {r['tokens_per_s']:7.1f} {r['ttft_p50_ms']:9.0f} "
                      f"{r['ttft_p99_ms']:7.0f} {r['itl_p50_ms']:8.1f} {r['itl_p99_ms']:6.1f} "
                      f"{r['tokens_per_answer_mean']:7.1f} {inv:>8}")
            q = level["ratios"]
            runs = q["json_sokuji_over_llama_server_runs"]
            print(f"{'':7s} json tok/s Sokuji / llama-server "
                  f"{q['json_sokuji_over_llama_server']:.3f}"
                  f" (runs {min(runs):.2f}-{max(runs):.2f}; target >= 1.0); Sokuji json / plain "
                  f"{q['sokuji_json_over_plain']:.3f} (target >= 0.95); llama-server json / "
                  f"plain {q['llama_server_json_over_plain']:.3f}; TTFT p50 / p99 ratio "
                  f"{q['ttft_p50_sokuji_over_llama_server']:.2f} / "
                  f"{q['ttft_p99_sokuji_over_llama_server']:.2f}")
    if "compile" in result:
        c = result["compile"]
        print(f"\nTTFT one at a time, fresh prompts, {args.compile_samples} samples (ms):")
        for name in (SK, LS):
            r = c[name]
            print(f"  {name:13s} cold schema p50 {r['cold_p50_ms']:6.1f} (p99 "
                  f"{r['cold_p99_ms']:6.1f}), cached {r['cached_p50_ms']:6.1f} (p99 "
                  f"{r['cached_p99_ms']:6.1f}), no schema {r['none_p50_ms']:6.1f}; paired "
                  f"cold - none {r['cold_minus_none_paired_p50_ms']:+.1f}, cached - none "
                  f"{r['cached_minus_none_paired_p50_ms']:+.1f}")
        print(f"  Sokuji / llama-server p50: cold {c['cold_p50_sokuji_over_llama_server']:.2f},"
              f" cached {c['cached_p50_sokuji_over_llama_server']:.2f}, none "
              f"{c['none_p50_sokuji_over_llama_server']:.2f}")
    if "logprobs" in result:
        print("\nlogprobs (Sokuji chat, top_logprobs 5) against none:")
        for n in args.logprobs_streams:
            r = result["logprobs"][str(n)]
            print(f"  {n} streams: {r['plain']['tokens_per_s']:.1f} -> "
                  f"{r['logprobs']['tokens_per_s']:.1f} tok/s ({r['tokens_per_s_ratio']:.3f}x);"
                  f" +{r['ms_per_token_added']:.3f} ms a token (aggregate); ITL p50 "
                  f"{r['plain']['itl_p50_ms']:.1f} -> {r['logprobs']['itl_p50_ms']:.1f} ms, "
                  f"mean +{r['itl_mean_added_ms']:.2f} ms")
