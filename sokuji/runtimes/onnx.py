"""ONNX Runtime adapter for text encoders: ``tokenizers`` in, one embedding per text out.

The graph takes ``input_ids``, ``attention_mask`` and (if it declares it) ``token_type_ids``,
int64 ``[batch, sequence]``, and returns ``[batch, dim]``. Requests are tokenised one by one
before queueing (no padding); ``run_batch`` pads the whole batch once, to its longest item.

A text is read only as far as the model reads it: its first ``max_sequence_length`` tokens.
A token of real text stands for at most as many characters as the vocabulary's longest
entry, so a text over ``cut_chars`` (= max_sequence_length x that length) is cut there before
tokenising. Not every token is of real text: whitespace runs, dropped characters and words the
tokenizer cannot split (one ``[UNK]`` for 150 letters) stand for more, and a plain cut would
then change the result. So the cut is kept only when it provably changes no kept token: the
window filled, and its last token comes from a word at least two words before the cut text's
last (cutting changes only the last word: normalizers map characters locally, pre-tokenizers
split with at most a character of look-ahead, models tokenise each word on its own).
Otherwise a text up to ``max_text_chars`` (4 x ``cut_chars``) is tokenised whole, and a longer
one is refused (400). Each text thus costs at most ~5 x ``cut_chars`` characters of
tokenising, however long it is (MiniLM: a 4608-character cut, ~1.3 ms).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.errors import ConfigError, InvalidInput, RuntimeFailed
from sokuji.runtimes.base import ModelMetadata, Prepared, TensorSpec

INPUT_NAME = "text"
OUTPUT_NAME = "embedding"
WHOLE_FACTOR = 4
"""A text whose cut cannot be kept is tokenised whole up to this many times ``cut_chars``."""


class NotATextEncoder(ConfigError):
    """The graph is not a text encoder's (no ``input_ids`` / ``attention_mask``): the
    ``onnx`` kind serves it as a tensor model instead, where it may."""


def auto_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else (os.cpu_count() or 1))


class OnnxEncoderRuntime:
    def __init__(self, model_path: str | Path, tokenizer_path: str | Path, *,
                 intra_op_threads: int = 0, max_sequence_length: int = 256) -> None:
        self.model_path = Path(model_path)
        self.tokenizer_path = Path(tokenizer_path)
        self.intra_op_threads = intra_op_threads or auto_threads()
        self.max_sequence_length = max_sequence_length
        self._session: Any = None
        self._tokenizer: Any = None
        self._input_names: tuple[str, ...] = ()
        self._output_name = ""
        self._dim = -1
        self.cut_chars = 0
        """Texts longer than this (characters) are cut before tokenising; set by ``load``."""
        self.max_text_chars = 0
        """The longest text tokenised whole when its cut cannot be kept; longer: 400."""

    def load(self) -> None:
        import onnxruntime as ort

        self.load_tokenizer()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.intra_op_threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Spinning threads steal the core that the event loop needs between batches.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._session = ort.InferenceSession(str(self.model_path), opts,
                                                 providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ConfigError.for_key("path", str(self.model_path),
                                      f"ONNX Runtime cannot load it: {exc}") from exc
        names = tuple(i.name for i in self._session.get_inputs())
        if "input_ids" not in names or "attention_mask" not in names:
            self._session = None
            raise NotATextEncoder.for_key(
                "path", str(self.model_path), f"expected inputs input_ids and attention_mask, "
                f"got {names}: not a text encoder (serve it as runtime = \"tensor\")")
        self._input_names = names
        output = self._session.get_outputs()[0]
        self._output_name = output.name
        last = output.shape[-1] if output.shape else None
        self._dim = last if isinstance(last, int) else -1

    def load_tokenizer(self) -> None:
        """The tokenizer alone (``load`` calls it), and the text bounds from its vocabulary."""
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(self.tokenizer_path))
        except Exception as exc:  # the library raises plain Exceptions: a config error
            raise ConfigError.for_key("tokenizer", str(self.tokenizer_path),
                                      f"cannot load: {exc}") from exc
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self.max_sequence_length)
        self._tokenizer = tokenizer
        self.cut_chars = self.max_sequence_length * longest_token_chars(tokenizer)
        self.max_text_chars = WHOLE_FACTOR * self.cut_chars

    def warmup(self) -> None:
        for n, words in ((1, 8), (8, 8), (4, 64)):
            prepared = self.preprocess([" ".join(["warm"] * words)] * n)
            self.run_batch([prepared])

    def describe(self) -> ModelMetadata:
        return ModelMetadata(
            platform="onnxruntime_onnx",
            inputs=(TensorSpec(INPUT_NAME, "BYTES", (-1,)),),
            outputs=(TensorSpec(OUTPUT_NAME, "FP32", (-1, self._dim)),),
        )

    def preprocess(self, texts: Sequence[str]) -> Prepared:
        """Token ids of each text, as far as the model reads it (see the module docstring).
        Thread-safe: the server calls it on the event loop for short inputs, in a worker
        thread for long ones."""
        assert self._tokenizer is not None, "load() first"
        if len(texts) == 1:
            if len(texts[0]) > self.cut_chars:
                return self._prepare_long(texts)
            ids = [np.asarray(self._tokenizer.encode(texts[0]).ids, dtype=np.int64)]
        else:
            if max(map(len, texts), default=0) > self.cut_chars:
                return self._prepare_long(texts)
            ids = [np.asarray(e.ids, dtype=np.int64)
                   for e in self._tokenizer.encode_batch(list(texts))]
        return _prepared(ids)

    def _prepare_long(self, texts: Sequence[str]) -> Prepared:
        cut = self.cut_chars
        encodings = self._tokenizer.encode_batch([t[:cut] for t in texts])
        for i, text in enumerate(texts):
            if len(text) <= cut or window_filled(encodings[i]):
                continue
            if len(text) > self.max_text_chars:
                raise InvalidInput(
                    f"text {i} of the request is {len(text)} characters long; this model "
                    f"reads {self.max_sequence_length} tokens, and a text over "
                    f"{self.max_text_chars} characters must fill them within its first "
                    f"{cut} characters (it is then cut there, with the same result). This "
                    "one's do not (long runs of whitespace, or words the tokenizer cannot "
                    f"split): send at most {self.max_text_chars} characters", param="input")
            encodings[i] = self._tokenizer.encode(text)
        return _prepared([np.asarray(e.ids, dtype=np.int64) for e in encodings])

    def feeds(self, rows: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Token-id rows padded once, to the longest, as the graph's inputs."""
        longest = max(len(r) for r in rows)
        input_ids = np.zeros((len(rows), longest), dtype=np.int64)
        mask = np.zeros((len(rows), longest), dtype=np.int64)
        for i, r in enumerate(rows):
            input_ids[i, :len(r)] = r
            mask[i, :len(r)] = 1
        feeds = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(input_ids)
        return feeds

    def run_batch(self, batch: Sequence[Prepared]) -> list[np.ndarray]:
        assert self._session is not None, "load() first"
        rows = [ids for p in batch for ids in p.data]
        feeds = self.feeds(rows)
        try:
            out = self._session.run([self._output_name], feeds)[0]
        except Exception as exc:
            raise RuntimeFailed(f"ONNX Runtime failed on a batch of {len(rows)}: {exc}") from exc
        results, start = [], 0
        for p in batch:
            results.append(out[start:start + p.num_items])
            start += p.num_items
        return results

    def close(self) -> None:
        # Only the session goes: a tokenisation still running in a worker thread keeps
        # its own reference to the tokenizer, so closing never frees anything under it.
        self._session = None


def _prepared(ids: list[np.ndarray]) -> Prepared:
    lengths = [len(x) for x in ids]
    return Prepared(data=ids, num_items=len(ids), length=max(lengths),
                    num_tokens=sum(lengths))


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of input text one vocabulary entry can stand for. A WordPiece
    or BPE continuation prefix (``##``) and an end-of-word suffix (``</w>``) stand for none;
    a byte-level BPE entry has one character per byte of its text, and a text has at least
    as many bytes as characters, so its length bounds those too. Added (special) tokens
    count as written: they match literally."""
    model = tokenizer.model
    prefix = getattr(model, "continuing_subword_prefix", None) or ""
    suffix = getattr(model, "end_of_word_suffix", None) or ""
    longest = 1
    for token in tokenizer.get_vocab():
        n = len(token)
        if prefix and token.startswith(prefix):
            n -= len(prefix)
        if suffix and token.endswith(suffix):
            n -= len(suffix)
        longest = max(longest, n)
    return longest


def window_filled(encoding: Any) -> bool:
    """Whether the tokens kept from a cut text are those of the whole text: the window
    filled (tokens overflowed), and its last token comes from a word at least two words
    before the cut text's last one. Cutting a text changes only its last word (its last
    two, to be safe): normalizers map characters locally, pre-tokenizers split with at most
    a character of look-ahead, models tokenise each word on its own. So the words before,
    and the tokens kept from them, are the whole text's."""
    if not encoding.overflowing:
        return False
    kept = _last_word(encoding.word_ids)
    last = _last_word(encoding.overflowing[-1].word_ids)
    return kept is not None and last is not None and kept <= last - 2


def _last_word(word_ids: Sequence[int | None]) -> int | None:
    return next((w for w in reversed(word_ids) if w is not None), None)
