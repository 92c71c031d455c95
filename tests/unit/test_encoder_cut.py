"""A long text is read only as far as the encoder reads it (``runtimes/onnx.py``): cut before
tokenising when that provably gives the whole text's tokens, else tokenised whole up to a
bound, else refused. Checked against the whole text's tokens on adversarial random texts
(whitespace runs, unsplittable words, combining marks, special-token text, CJK, emoji), at
several window sizes, with three kinds of tokenizer: MiniLM's own (BERT WordPiece), a
byte-level BPE and a SentencePiece-style Unigram (NFKC, collapsed spaces, Metaspace).
Tokenizers only: no ONNX session is loaded."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.processors import TemplateProcessing

from sokuji.errors import InvalidInput
from sokuji.runtimes.onnx import OnnxEncoderRuntime, longest_token_chars, window_filled
from sokuji.weights import minilm

DENSE = ["hello", "world", " ", " ", " ", ".", ",", "é", "e\u0301", "東京", "unbelievable",
         "ab-cd", "'s", "1234567", "telecommunications", "🙂", "naïve", "x=1;"]
SPARSE = ["\n", "\t", "   " * 20, "\u0301" * 30, "x" * 150, "a" * 99, "\x00" * 10, "[UNK]",
          "[CLS]", "<s>", " " * 200]


def byte_level_bpe(path: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(DENSE * 3), "the quick brown fox jumps over the lazy dog " * 5]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = TemplateProcessing(single="<s> $A </s>",
                                            special_tokens=[("<s>", 0), ("</s>", 1)])
    tok.save(str(path))
    return path


def unigram(path: Path) -> Path:
    rng = random.Random(3)
    vocab, seen = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)], set()
    for _ in range(400):
        piece = ("▁" if rng.random() < 0.5 else "") + "".join(
            rng.choice("abcdehlorw") for _ in range(rng.randint(1, 6)))
        if piece not in seen:
            seen.add(piece)
            vocab.append((piece, -rng.random() * 10))
    vocab += [(c, -12.0) for c in "abcdehlorwé東京.,▁" if c not in seen]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(),
                                           normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.post_processor = TemplateProcessing(single="<s> $A </s>",
                                            special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.save(str(path))
    return path


@pytest.fixture(scope="module", params=["minilm", "byte-level-bpe", "unigram"])
def tokenizer_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Path:
    if request.param == "minilm":
        return Path(minilm.tokenizer_path())
    build = byte_level_bpe if request.param == "byte-level-bpe" else unigram
    return build(tmp_path_factory.mktemp(request.param) / "tokenizer.json")


def runtime_for(path: Path, window: int) -> OnnxEncoderRuntime:
    runtime = OnnxEncoderRuntime("not-loaded.onnx", path, max_sequence_length=window)
    runtime.load_tokenizer()
    return runtime


def random_text(rng: random.Random, cut: int) -> str:
    mix = DENSE + SPARSE * rng.choice([0, 0, 1, 3])
    parts: list[str] = []
    target, total = rng.randint(cut // 2, 5 * cut), 0
    while total < target:
        parts.append(rng.choice(mix))
        total += len(parts[-1])
    return "".join(parts)


@pytest.mark.parametrize("window", [4, 16, 64])
def test_a_long_text_gives_the_whole_texts_tokens_or_a_400(tokenizer_path: Path,
                                                           window: int) -> None:
    runtime = runtime_for(tokenizer_path, window)
    whole = Tokenizer.from_file(str(tokenizer_path))  # the reference: reads everything
    whole.no_padding()
    whole.enable_truncation(max_length=window)
    cut, limit = runtime.cut_chars, runtime.max_text_chars
    rng = random.Random(window)
    seen: Counter[str] = Counter()
    batch: list[str] = []
    for _ in range(300):
        text = random_text(rng, cut)
        expected = whole.encode(text).ids
        if len(text) <= cut:
            kind = "short"
        elif window_filled(whole.encode(text[:cut])):
            kind = "cut"
        else:
            kind = "whole" if len(text) <= limit else "refused"
        seen[kind] += 1
        if kind == "refused":
            with pytest.raises(InvalidInput) as exc:
                runtime.preprocess([text])
            assert f"send at most {limit} characters" in exc.value.message
            assert exc.value.param == "input"
            continue
        prepared = runtime.preprocess([text])
        assert prepared.data[0].tolist() == expected, (kind, text[:200])
        assert prepared.num_tokens == len(expected)
        batch.append(text)
    assert seen["short"] and seen["cut"], seen
    if "byte-level" not in str(tokenizer_path):  # it keeps every byte: a cut always holds
        assert seen["whole"] and seen["refused"], seen
    # several texts in one request: each as if alone
    together = runtime.preprocess(batch[:16])
    assert [ids.tolist() for ids in together.data] == [whole.encode(t).ids for t in batch[:16]]


def test_a_plain_cut_would_change_the_result() -> None:
    """Why the cut is checked: "hello" after 5000 spaces is [CLS] hello [SEP] whole, but a
    plain cut at 256 x the longest token (4608 characters) leaves [CLS] [SEP]."""
    runtime = runtime_for(Path(minilm.tokenizer_path()), 256)
    text = " " * 5000 + "hello"
    plain = runtime._tokenizer.encode(text[:runtime.cut_chars]).ids
    assert runtime.preprocess([text]).data[0].tolist() == [101, 7592, 102] != plain


def test_the_longest_token_counts_characters_of_text() -> None:
    runtime = runtime_for(Path(minilm.tokenizer_path()), 256)
    assert runtime.cut_chars == 256 * len("telecommunications")  # MiniLM's longest
    assert runtime.max_text_chars == 4 * runtime.cut_chars
    # a WordPiece "##" continuation stands for no text
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "ab": 1, "##cdefghijkl": 2},
                                     unk_token="[UNK]"))
    assert longest_token_chars(tok) == len("cdefghijkl")
