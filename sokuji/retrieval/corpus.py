"""The built-in corpus: Python's language reference topics (``pydoc_data.topics``, stdlib),
cut into passages.

A topic is split into sections at its underlined headings, a section into paragraphs at
blank lines; paragraphs are packed greedily into passages of at most ``max_units`` units (see
``MAX_UNITS``; a longer paragraph is cut at line ends), and a passage under ``min_units``
units continues into the next section. Each passage starts with its section heading (context
for both BM25 and the encoder). Several topics repeat others (``compound`` holds ``if``,
``while``, ...;
``specialnames`` holds ``customization``, ...): topics are read smallest first and a
paragraph already seen is dropped, so each text is indexed once, under its most specific
topic. Passage ids are ``topic:n``; they depend on the Python version's topics text, which
the corpus checksum (``corpus_checksum``) pins in an index's manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MIN_UNITS = 60
MAX_UNITS = 180
"""A passage's size in units: words and punctuation marks counted apart (``\\w+|[^\\w\\s]``),
which tracks MiniLM's WordPiece tokens without loading a tokenizer. At 180 units the built-in
corpus has a median of ~165 tokens (~90 words) and 6 of 652 passages over the encoder's
256-token window (by at most 12 tokens, which only BM25 then reads)."""

CATEGORIES: dict[str, tuple[str, ...]] = {
    "statements": (
        "assert", "assignment", "augassign", "async", "break", "class", "compound",
        "continue", "del", "else", "for", "function", "global", "if", "import", "nonlocal",
        "pass", "raise", "return", "try", "while", "with", "yield"),
    "expressions": (
        "atom-identifiers", "atom-literals", "attribute-references", "await", "binary",
        "bitwise", "booleans", "calls", "comparisons", "conversions", "dict", "exprlists",
        "in", "lambda", "lists", "operator-summary", "power", "shifting", "slicings",
        "subscriptions", "unary"),
    "data-model": (
        "attribute-access", "callable-types", "context-managers", "customization",
        "numeric-types", "objects", "sequence-types", "specialattrs", "specialnames",
        "types"),
    "lexical": ("floating", "id-classes", "identifiers", "imaginary", "integers", "numbers",
                "strings"),
    "builtin-types": (
        "bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object",
        "bltin-type-objects", "formatstrings", "string-methods", "truth", "typesfunctions",
        "typesmapping", "typesmethods", "typesmodules", "typesseq", "typesseq-mutable"),
    "execution": ("dynamic-features", "exceptions", "execmodel", "naming"),
}
CATEGORY_OF = {topic: cat for cat, topics in CATEGORIES.items() for topic in topics}
OTHER = "other"

_UNIT = re.compile(r"\w+|[^\w\s]")
_UNDERLINE = re.compile(r"^([*=\-^~])\1{2,}$")


@dataclass(frozen=True)
class Passage:
    """One retrievable unit: ``id`` unique in its corpus; ``metadata`` plain strings (the
    keys filters may name)."""

    id: str
    text: str
    metadata: dict[str, str] = field(default_factory=dict)


def category(topic: str) -> str:
    return CATEGORY_OF.get(topic, OTHER)


def sections(text: str) -> list[tuple[str, list[str]]]:
    """``(heading, paragraphs)`` in order; the text before the first heading has ``""``."""
    lines = text.splitlines()
    out: list[tuple[str, list[str]]] = [("", [])]
    para: list[str] = []

    def flush() -> None:
        if para and any(s.strip() for s in para):
            out[-1][1].append("\n".join(para).strip("\n"))
        para.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and _UNDERLINE.match(nxt) and len(nxt) >= len(line.rstrip()) - 1:
            flush()
            out.append((line.strip(), []))
            i += 2
            continue
        if not line.strip():
            flush()
        else:
            para.append(line)
        i += 1
    flush()
    return [(h, ps) for h, ps in out if ps]


def _units(text: str) -> int:
    return len(_UNIT.findall(text))


def _split_long(paragraph: str, max_units: int) -> list[str]:
    """A paragraph over ``max_units`` units cut at line ends (code blocks and prose alike)."""
    pieces: list[str] = []
    cur: list[str] = []
    n = 0
    for line in paragraph.splitlines():
        w = _units(line)
        if cur and n + w > max_units:
            pieces.append("\n".join(cur))
            cur, n = [], 0
        cur.append(line)
        n += w
    if cur:
        pieces.append("\n".join(cur))
    return pieces


def chunk_topic(text: str, *, seen: set[str], min_units: int = MIN_UNITS,
                max_units: int = MAX_UNITS) -> list[str]:
    """Passages of one topic; paragraphs in ``seen`` are skipped, new ones added to it."""
    chunks: list[str] = []
    cur: list[str] = []
    n = 0
    for heading, paragraphs in sections(text):
        fresh = []
        for p in paragraphs:
            key = " ".join(p.split())
            if key in seen:
                continue
            seen.add(key)
            fresh.extend(_split_long(p, max_units))
        if not fresh:
            continue
        if cur and n >= min_units:
            chunks.append("\n\n".join(cur))
            cur, n = [], 0
        for p in fresh:
            w = _units(p)
            if cur and n + w > max_units and n >= min_units // 2:
                chunks.append("\n\n".join(cur))
                cur, n = [], 0
            if not cur and heading:
                cur.append(heading)
                n += _units(heading)
            cur.append(p)
            n += w
    if cur and n:
        chunks.append("\n\n".join(cur))
    return chunks


def passages_from_topics(topics: dict[str, str], *, min_units: int = MIN_UNITS,
                         max_units: int = MAX_UNITS) -> list[Passage]:
    """Passages of all topics (smallest topics first claim shared paragraphs), in topic
    name order."""
    seen: set[str] = set()
    by_topic: dict[str, list[str]] = {}
    # Equal texts go to the topic named in its own title ("if", not "else").
    for name in sorted(topics, key=lambda t: (len(topics[t]), f'"{t}"' not in topics[t][:80],
                                              t)):
        by_topic[name] = chunk_topic(topics[name], seen=seen, min_units=min_units,
                                     max_units=max_units)
    out: list[Passage] = []
    for name in sorted(by_topic):
        title = topics[name].split("\n", 1)[0].strip()
        for n, text in enumerate(by_topic[name]):
            out.append(Passage(f"{name}:{n}", text, {
                "topic": name, "category": category(name), "title": title}))
    return out


def pydoc_stopwords() -> list[str]:
    """BM25's stopwords for this corpus: bm25s' English list less Python's keywords ("if",
    "for", "with", "in", "is", "not", "and", "or", "as" are this corpus' subject)."""
    import keyword

    from sokuji.retrieval.bm25 import english_stopwords

    return english_stopwords(frozenset(keyword.kwlist) | frozenset(keyword.softkwlist)
                             | {w.lower() for w in keyword.kwlist})


def pydoc_passages(*, min_units: int = MIN_UNITS, max_units: int = MAX_UNITS) -> list[Passage]:
    """The built-in corpus (this Python's ``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    return passages_from_topics(dict(topics), min_units=min_units, max_units=max_units)


def corpus_checksum(passages: Iterable[Passage]) -> str:
    """SHA-256 over ids, texts and metadata, in order."""
    h = hashlib.sha256()
    for p in passages:
        h.update(json.dumps([p.id, p.text, p.metadata], sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def find(passages: Sequence[Passage], phrase: str, topic: str | None = None) -> list[str]:
    """Ids of the passages containing ``phrase`` (whitespace-insensitive, case-sensitive),
    within ``topic`` when given."""
    needle = " ".join(phrase.split())
    return [p.id for p in passages
            if (topic is None or p.metadata.get("topic") == topic)
            and needle in " ".join(p.text.split())]
