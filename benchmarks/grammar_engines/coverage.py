"""JSON-schema feature coverage: does each engine compile the schema (else: its exception text),
accept a conforming document (token by token, then EOS), and reject a violating one?

    python coverage.py ENGINE [ENGINE...] [--out-dir DIR]     (ENGINE: llg xgr oc lcpp)

Prints a table and writes ``DIR/coverage-ENGINE.json`` (default: the current folder).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import common
import engines
import numpy as np
from engines import W, allowed


def obj(props, req=None, **kw):
    """A closed object schema; every property required unless ``req`` says otherwise."""
    return {
        "type": "object",
        "properties": props,
        "required": req if req is not None else list(props),
        "additionalProperties": False,
        **kw,
    }


CASES = [
    # name, schema, good value, bad value (None: no bad case)
    ("format:email", {"type": "string", "format": "email"}, "ada@example.com", "not an email"),
    (
        "format:date-time",
        {"type": "string", "format": "date-time"},
        "2024-01-02T03:04:05Z",
        "yesterday",
    ),
    ("format:date", {"type": "string", "format": "date"}, "2024-01-02", "2024-13-45x"),
    ("format:time", {"type": "string", "format": "time"}, "03:04:05Z", "noon"),
    (
        "format:uuid",
        {"type": "string", "format": "uuid"},
        "123e4567-e89b-12d3-a456-426614174000",
        "xyz",
    ),
    (
        "format:uri",
        {"type": "string", "format": "uri"},
        "https://example.com/a",
        "no spaces allowed",
    ),
    ("format:ipv4", {"type": "string", "format": "ipv4"}, "10.0.0.1", "999.x"),
    ("format:hostname", {"type": "string", "format": "hostname"}, "example.com", "bad host!"),
    (
        "minLength/maxLength",
        {"type": "string", "minLength": 2, "maxLength": 5},
        "abc",
        "abcdefghij",
    ),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ABC-12", "abc-12"),
    (
        "minItems/maxItems",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [1, 2],
        [1, 2, 3, 4],
    ),
    (
        "minItems (too few)",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [1, 2, 3],
        [1],
    ),
    ("integer minimum/maximum", {"type": "integer", "minimum": 0, "maximum": 150}, 36, 151),
    ("integer exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 0}, 5, 0),
    ("number minimum/maximum", {"type": "number", "minimum": 0.5, "maximum": 2.5}, 1.25, 3.5),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
    ("enum (mixed)", {"enum": ["red", 1, None]}, "red", "blue"),
    ("const", {"const": "person"}, "person", "persona"),
    (
        "$ref/$defs",
        {
            "$defs": {"p": obj({"x": {"type": "integer"}})},
            "type": "array",
            "items": {"$ref": "#/$defs/p"},
        },
        [{"x": 1}],
        [{"y": 1}],
    ),
    (
        "recursive $ref",
        {
            "$defs": {
                "n": obj(
                    {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}},
                    }
                )
            },
            "$ref": "#/$defs/n",
        },
        {"v": 1, "kids": [{"v": 2, "kids": []}]},
        {"v": 1, "kids": [{"v": "x", "kids": []}]},
    ),
    ("anyOf", {"anyOf": [{"type": "integer"}, obj({"a": {"type": "string"}})]}, {"a": "x"}, [1]),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "x", [1]),
    (
        "allOf",
        {"allOf": [obj({"a": {"type": "integer"}}, ["a"]), {"required": ["a"]}]},
        {"a": 1},
        {"a": "x"},
    ),
    ("type list", {"type": ["string", "null"]}, None, 1),
    ("additionalProperties:false", obj({"a": {"type": "integer"}}), {"a": 1}, {"a": 1, "b": 2}),
    (
        "required (missing)",
        obj({"a": {"type": "integer"}, "b": {"type": "integer"}}),
        {"a": 1, "b": 2},
        {"a": 1},
    ),
    (
        "optional property",
        obj({"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a"]),
        {"a": 1},
        {"b": 1},
    ),
    (
        "additionalProperties:schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"k": 1, "z": 2},
        {"k": "x"},
    ),
    (
        "minProperties/maxProperties",
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "minProperties": 1,
            "maxProperties": 2,
        },
        {"a": 1},
        {"a": 1, "b": 2, "c": 3},
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "patternProperties": {"^x_": {"type": "integer"}},
            "additionalProperties": False,
        },
        {"x_a": 1},
        {"y": 1},
    ),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        [1, "a"],
        ["a", 1],
    ),
    (
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [1, 2],
        [1, 1],
    ),
    (
        "contains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}},
        [1, 7],
        [1, 2],
    ),
    ("not", {"not": {"type": "integer"}}, "x", 1),
    (
        "if/then/else",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["a"]},
        },
        {"a": 1},
        None,
    ),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1, "b": 2},
        {"a": 1},
    ),
    ("external $ref", {"$ref": "https://example.com/schema.json"}, 1, None),
    ("unknown keyword x-foo", {"type": "integer", "x-foo": 1}, 1, "a"),
    ("bad schema (type: 5)", {"type": 5}, 1, None),
]


def enc(v):
    return json.dumps(v, separators=(",", ":"))


def verdict_of(row):
    if row["good_accepted"] and row["bad_rejected"]:
        return "enforced"
    if row["good_accepted"] and row["bad_rejected"] is False:
        return "IGNORED (bad doc accepted)"
    return "n/a" if row["good_accepted"] else "GOOD DOC REJECTED"


def walk(eng, g, text):
    """True if every token of ``text`` (then EOS) is allowed in turn."""
    m = eng.matcher(g)
    mask = np.zeros((1, W), dtype=np.int32)
    for t in [*common.hf_tokenizer().encode(text).ids, common.eos_id()]:
        eng.fill(m, mask)
        if not allowed(mask, t):
            return False
        try:
            eng.accept(m, t)
        except Exception:  # noqa: BLE001 (an engine refusing the token: the doc is cut off)
            return False
    return True


def main(key, out_dir):
    eng = engines.ENGINES[key]()
    rows = []
    for name, schema, good, bad in CASES:
        row = {"feature": name}
        try:
            t0 = time.perf_counter()
            g = eng.compile(schema)
            eng.matcher(g)
            row["compile_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        except Exception as e:  # noqa: BLE001 (any refusal is a result: its text is recorded)
            row["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            rows.append(row)
            print(f"{name:30s} REFUSED  {row['error'][:200]!r}")
            continue
        row["good_accepted"] = walk(eng, g, enc(good))
        row["bad_rejected"] = None if bad is None else not walk(eng, g, enc(bad))
        verdict = verdict_of(row)
        row["verdict"] = verdict
        print(f"{name:30s} compiled {row['compile_ms']:8.1f} ms  {verdict}")
        rows.append(row)
    with open(Path(out_dir) / f"coverage-{key}.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engines", nargs="+", choices=sorted(engines.ENGINES))
    ap.add_argument("--out-dir", default=".", help="where coverage-ENGINE.json goes")
    args = ap.parse_args()
    for k in args.engines:
        print(f"===== {k}")
        main(k, args.out_dir)
