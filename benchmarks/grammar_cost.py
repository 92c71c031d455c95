"""What structured outputs cost per request and per token (``sokuji.llm.grammar``, llguidance),
against SmolLM2's real vocabulary (vocab-only: no weights, no decode).

Figures: building the Vocabulary (once per model); parsing ``response_format`` (event loop);
compiling one realistic schema cold (a fresh ``Grammars`` each time: no cache); a cached
lookup; a matcher from a compiled grammar; the mask per token along a scripted walk of a
valid document (``Matcher.fill``), and ``fill_many`` for 8 sequences in one call.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/grammar_cost.py [--repeat 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sokuji.llm import grammar as G
from sokuji.llm import native

SCHEMA: dict[str, Any] = {
    "$defs": {
        "address": {"type": "object", "additionalProperties": False,
                    "required": ["street", "city"],
                    "properties": {"street": {"type": "string", "maxLength": 40},
                                   "city": {"type": "string", "maxLength": 30},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "tag": {"enum": ["red", "green", "blue"]}},
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "kind", "home", "tags", "contact", "score", "active", "when"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"const": "person"},
        "home": {"$ref": "#/$defs/address"},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1,
                 "maxItems": 3},
        "contact": {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["email"],
             "properties": {"email": {"type": "string", "format": "email"}}},
            {"type": "object", "additionalProperties": False, "required": ["phone"],
             "properties": {"phone": {"type": "string", "maxLength": 15}}}]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
        "when": {"type": "string", "format": "date-time"}}}
DOC = {"name": "Ada Lovelace", "age": 36, "kind": "person",
       "home": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
       "tags": ["red", "blue"], "contact": {"email": "ada@example.com"}, "score": 98.5,
       "active": True, "when": "1843-07-10T09:30:00Z"}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def _times(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _show(what: str, ms: list[float]) -> None:
    ms = sorted(ms)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    print(f"{what:44s} n={len(ms):5d}  mean {statistics.fmean(ms):8.4f} ms  "
          f"p50 {ms[len(ms) // 2]:8.4f}  p99 {p99:8.4f}  max {ms[-1]:8.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    t0 = time.perf_counter()
    vocab = G.Vocabulary.from_gguf(native.smollm2_path())
    print(f"Vocabulary.from_gguf (vocab-only load + llguidance tokenizer, once per model): "
          f"{time.perf_counter() - t0:.3f} s; {vocab.n_vocab} tokens, EOG {vocab.eog_ids}")

    _show("parse_response_format (event loop)", _times(lambda: G.parse_response_format(RF),
                                                        args.repeat * 10))
    spec = G.parse_response_format(RF)
    assert spec is not None
    print(f"schema: {len(spec.text)} bytes compact")
    _show("compile, cold (fresh Grammars)",
          _times(lambda: G.Grammars(vocab).compile(spec, "t"), args.repeat))
    steps, G.PROBE_STEPS = G.PROBE_STEPS, 0
    _show("compile, cold, without the probe walk",
          _times(lambda: G.Grammars(vocab).compile(spec, "t"), args.repeat))
    G.PROBE_STEPS = steps
    grammars = G.Grammars(vocab)
    compiled = grammars.compile(spec, "t")
    _show("Grammars.cached (hit)", _times(lambda: grammars.cached(spec, "t"), args.repeat * 100))
    _show("Grammars.compile (hit)", _times(lambda: grammars.compile(spec, "t"),
                                           args.repeat * 100))
    _show("Compiled.matcher()", _times(compiled.matcher, args.repeat * 100))

    tokens = vocab.tokenize(json.dumps(DOC, separators=(",", ":")))
    mask = vocab.allocate(1)[0]
    fills: list[float] = []
    consumes: list[float] = []
    for _ in range(args.repeat):
        m = compiled.matcher()
        for t in tokens:
            t0 = time.perf_counter()
            assert m.fill(mask)
            t1 = time.perf_counter()
            assert m.consume(t), m.error
            t2 = time.perf_counter()
            fills.append((t1 - t0) * 1e3)
            consumes.append((t2 - t1) * 1e3)
        assert m.done
    print(f"scripted walk: {len(tokens)} tokens per document, {args.repeat} documents")
    _show("Matcher.fill, per token", fills)
    _show("Matcher.consume, per token", consumes)

    rows = 8
    masks = vocab.allocate(rows)
    batch: list[float] = []
    for _ in range(args.repeat):
        ms = [compiled.matcher() for _ in range(rows)]
        for t in tokens:
            t0 = time.perf_counter()
            assert all(G.fill_many([(m, i) for i, m in enumerate(ms)], masks))
            batch.append((time.perf_counter() - t0) * 1e3)
            for m in ms:
                m.consume(t)
    _show(f"fill_many, {rows} sequences, per step", batch)
    unpack: list[float] = []
    logits = np.zeros(vocab.n_vocab, dtype=np.float32)
    for _ in range(args.repeat * 20):
        t0 = time.perf_counter()
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little", count=vocab.n_vocab)
        logits[bits == 0] = -np.inf
        unpack.append((time.perf_counter() - t0) * 1e3)
    _show("(for scale) numpy unpack + -inf of one row", unpack)


if __name__ == "__main__":
    main()
