"""Format and hygiene checks of the intent-classification set in ``sokuji/routing/data/``.

The set is what the cascade benchmark is measured on (issue 15): 20 intents, 10 prototypes,
15 calibration and 25 test queries each. These tests pin what the README promises: the line
format, the counts, the tags and what each tag means, and that no query repeats or nearly
repeats another text (a test query that copies a prototype would measure memory, not the
models). The text rules below (normalisation, content words, crude stemming) are the
definitions the README refers to.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parents[2] / "sokuji" / "routing" / "data"
SPLITS = {"prototypes": 10, "calib": 15, "test": 25}
N_LABELS = 20
TAGS = {"paraphrase", "lexical-trap", "plain"}
NEAR_DUPLICATE_RATIO = 0.85

# Function words and conversational filler: everything else is a content word.
_STOP_TEXT = """
a about above after again against all also am an and any anything are aren as at be because
been before being below between both but by can cannot could couldn d did didn do does doesn
doing don down during each either else even ever every few for from further get gets getting
got had hadn has hasn have haven having he her here hers herself him himself his how i if in
into is isn it its itself just ll m me might mine more most must mustn my myself need needs
no nor not now o of off on once only or other our ours ourselves out over own please re
really s same shall she should shouldn so some still such t than that the their theirs them
themselves then there these they this those through to too under until up upon ve very was
wasn we were weren what when where which while who whom whose why will with won would
wouldn yet you your yours yourself yourselves hi hello hey thanks thank want wanted like
would ll d let lets tell know help just also already yes ok okay oh im ive id ill youre
youve its cant didnt doesnt dont hasnt havent isnt wont wasnt arent couldnt wouldnt shouldnt
theres whats thats heres hes shes theyre weve theyve
"""
STOPWORDS = frozenset(_STOP_TEXT.split())

_WORD = re.compile(r"[a-z0-9]+")
_PUNCT = re.compile(r"[^a-z0-9\s]+")
_SUFFIXES = ("ing", "ed", "es", "s", "ly")


def normalise(text: str) -> str:
    """Lowercase, apostrophes dropped, other punctuation a space, whitespace collapsed."""
    text = text.lower().replace("'", "").replace("\u2019", "")
    return " ".join(_PUNCT.sub(" ", text).split())


def stem(word: str) -> str:
    """A crude stemmer: enough to make charge/charged/charges, cancel/cancelled and
    arrive/arrived the same word, without a dependency."""
    for suffix in _SUFFIXES:
        if suffix == "s" and word.endswith("ss"):
            break
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            break
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]
    if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "aeiousl":
        word = word[:-1]
    if word.endswith("ll") and len(word) > 4:
        word = word[:-1]
    return word


def content_words(text: str) -> set[str]:
    return {stem(w) for w in _WORD.findall(normalise(text)) if w not in STOPWORDS}


def read(split: str) -> list[dict[str, str]]:
    lines = (DATA / f"intents_{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def prototype_words(rows: Iterable[dict[str, str]]) -> dict[str, set[str]]:
    words: dict[str, set[str]] = {}
    for row in rows:
        words.setdefault(row["label"], set()).update(content_words(row["text"]))
    return words


@pytest.fixture(scope="module")
def sets() -> dict[str, list[dict[str, str]]]:
    return {split: read(split) for split in SPLITS}


def test_line_format(sets: dict[str, list[dict[str, str]]]) -> None:
    for split, rows in sets.items():
        keys = {"text", "label"} if split == "prototypes" else {"text", "label", "tag"}
        for row in rows:
            assert set(row) == keys, (split, row)
            assert all(isinstance(v, str) and v == v.strip() and v for v in row.values())
            assert re.fullmatch(r"[a-z][a-z_]*[a-z]", row["label"]), row
            if split != "prototypes":
                assert row["tag"] in TAGS, row


def test_labels_and_counts(sets: dict[str, list[dict[str, str]]]) -> None:
    labels = {split: Counter(r["label"] for r in rows) for split, rows in sets.items()}
    assert len(labels["prototypes"]) == N_LABELS
    for split, per_label in SPLITS.items():
        assert set(labels[split]) == set(labels["prototypes"]), split
        assert set(labels[split].values()) == {per_label}, (split, labels[split])


def test_tag_mix(sets: dict[str, list[dict[str, str]]]) -> None:
    """Every label has lexical traps and plain queries; paraphrases (no content word in
    common with the label's prototypes) are at least a sixth of each split. Some intents
    have almost none: no natural wording of "my card hasn't arrived" avoids "card"."""
    for split in ("calib", "test"):
        tags: dict[str, Counter[str]] = {}
        for row in sets[split]:
            tags.setdefault(row["label"], Counter())[row["tag"]] += 1
        assert all(t["lexical-trap"] >= 3 and t["plain"] >= 3 for t in tags.values()), tags
        total = sum(tags.values(), Counter())
        assert total["paraphrase"] >= len(sets[split]) / 6, total


def test_tags_mean_what_they_say(sets: dict[str, list[dict[str, str]]]) -> None:
    own = prototype_words(sets["prototypes"])
    for split in ("calib", "test"):
        for row in sets[split]:
            words = content_words(row["text"])
            shared = words & own[row["label"]]
            if row["tag"] == "paraphrase":
                assert not shared, (row, shared)
            elif row["tag"] == "plain":
                assert shared, row
            else:
                other = set().union(*(w for lab, w in own.items() if lab != row["label"]))
                assert words & other, row


def test_no_duplicates_or_near_duplicates(sets: dict[str, list[dict[str, str]]]) -> None:
    texts = [(split, normalise(r["text"])) for split, rows in sets.items() for r in rows]
    counts = Counter(t for _, t in texts)
    assert not [t for t, n in counts.items() if n > 1]
    # difflib's quick_ratio (2 x shared characters, as multisets, / total length) bounds its
    # ratio from above: computed for every pair at once from character counts, then ratio
    # only where the bound allows a near duplicate.
    alphabet = {c: i for i, c in enumerate(sorted({c for _, t in texts for c in t}))}
    counts_m = np.zeros((len(texts), len(alphabet)), dtype=np.int32)
    for row, (_, t) in enumerate(texts):
        for c in t:
            counts_m[row, alphabet[c]] += 1
    lengths = counts_m.sum(axis=1)
    near = []
    for i in range(len(texts) - 1):
        shared = np.minimum(counts_m[i], counts_m[i + 1:]).sum(axis=1)
        bound = 2 * shared / (lengths[i] + lengths[i + 1:])
        for j in np.nonzero(bound >= NEAR_DUPLICATE_RATIO)[0] + i + 1:
            (sa, a), (sb, b) = texts[i], texts[j]
            if difflib.SequenceMatcher(None, a, b, autojunk=False).ratio() \
                    >= NEAR_DUPLICATE_RATIO:
                near.append((sa, a, sb, b))
    assert not near, near[:5]


def test_queries_do_not_copy_prototypes(sets: dict[str, list[dict[str, str]]]) -> None:
    protos = {normalise(r["text"]) for r in sets["prototypes"]}
    for split in ("calib", "test"):
        for row in sets[split]:
            text = normalise(row["text"])
            assert text not in protos, row
            assert not any(p in text for p in protos if len(p.split()) >= 4), row
