"""Structured outputs: a grammar per request, enforced by a per-sequence token mask.

The engine is llguidance (chosen by measurement against xgrammar, outlines-core and llama.cpp's
own grammar sampler, for issue 28; user-facing docs: docs/structured-outputs.md). Three
steps, each where it belongs:

1. **On the event loop, cheap** (no compile): ``parse_response_format(value)`` (OpenAI's
   ``response_format``), ``parse_json_schema(value)`` (llama-server's ``json_schema``) and
   ``parse_gbnf(value)`` (llama-server's ``grammar``) check the request's field and return a
   ``GrammarSpec`` (or ``None``: no constraint). Every refusal here is an ``InvalidInput``
   (400) or a ``LimitExceeded`` (413) whose ``param`` names the field. The size and nesting
   limits (``MAX_SCHEMA_BYTES``, ``MAX_SCHEMA_DEPTH``, ``MAX_GRAMMAR_BYTES``) are checked here,
   before anything is compiled.
2. **On a worker thread** (llguidance drops the GIL while it builds):
   ``Grammars.compile(spec, tenant) -> Compiled``, or ``await Grammars.acompile(spec,
   tenant)`` from the event loop (a hit at once, a miss on ``asyncio.to_thread``). One
   ``Grammars`` per loaded model (it holds the model's ``Vocabulary``). Results, refusals
   included, are kept in an LRU bounded in entries and keyed by the tuple
   ``(tenant, kind, text)``, so one tenant's schema is never another's entry.
   ``Grammars.cached(spec, tenant)`` is the non-blocking lookup. Whatever llguidance refuses
   (``Unimplemented keys: ["uniqueItems"]``, ``Unknown format: credit-card``, an
   unsatisfiable schema, a bad regex, a malformed GBNF) is an ``InvalidInput`` naming the
   field, with llguidance's text. llguidance's ``lenient`` mode (which ignores what it cannot
   enforce) is never set, and a schema's own ``x-guidance`` options are refused, so a
   constraint is either enforced or refused, never silently dropped. Compiling also walks
   the grammar's first ``PROBE_STEPS`` steps, so a grammar that fails at once (a parser row
   past llguidance's limit, a grammar that never ends or describes no text) is a 400 rather
   than a failed generation.
3. **In the engine, per sequence**: ``Compiled.matcher() -> Matcher`` (a copy of a pristine
   matcher: about a microsecond). Each step: ``matcher.fill(mask)`` writes the allowed tokens
   for the next position (packed int32 words, bit ``i % 32`` of word ``i // 32`` = token ``i``,
   the layout ``sokuji.llm.sampling`` takes as ``allowed``), or ``fill_many`` for several
   matchers in one call; after sampling, ``matcher.consume(token)``. Then:

   - ``matcher.done``: the document is complete and nothing may follow: end the sequence with
     finish reason ``"stop"`` (keep the token just consumed; no EOS will come).
   - ``matcher.accepting``: the document may end here, so the mask holds the model's
     end-of-generation tokens (all of ``Vocabulary.eog_ids``); sampling one ends the sequence
     (``"stop"``) as usual. While it is false, no end-of-generation token is allowed, so the
     engine's ``ban_eog`` (``min_tokens``, ``ignore_eos``) has nothing to add. When
     ``ban_eog`` applies while it is true, the grammar goes on where it can (more digits);
     but once ``done``, the mask allows the EOG tokens only, so the engine must end the
     sequence on ``done`` whatever ``ignore_eos``/``min_tokens`` say (else every logit is
     ``-inf``).
   - ``matcher.error``: not ``None`` when the grammar cannot go on (a token outside the mask
     was consumed, llguidance's per-step fuel ran out, or no token is allowed): end the
     sequence with a clear reason (the text says why); never keep sampling.

Compact JSON: whitespace between tokens is not allowed (llguidance's ``whitespace_flexible``
off, separators ``,`` and ``:``), so a small model cannot loop on spaces or newlines.

**What bounds a number's digits** (llguidance offers no digit cap of its own): an ``integer``
with both ``minimum`` and ``maximum`` has bounded digits; a ``number`` with a decimal
``multipleOf`` (``0.01``) has bounded fraction digits, and with ``minimum``/``maximum`` a
bounded integer part and exponent, but its fraction digits stay unbounded without
``multipleOf`` (``0.000…01`` is in range). An unbounded ``integer``/``number`` (and a
``string`` without ``maxLength``, an ``array`` without ``maxItems``) lets a model write
``1111…`` until ``max_tokens``: the answer then ends with finish reason ``"length"`` and is not
valid JSON. Nothing here can prevent that without changing the schema's meaning; a
``pattern`` on a string or bounds on numbers are the client's means.

llguidance is imported lazily (it is in the ``llm`` extra); the request-side parsing needs
nothing but the standard library.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.errors import InvalidInput
from sokuji.llm.grammar_spec import (  # noqa: F401 (named here too: the module's users)
    LIMITS,
    MAX_GRAMMAR_BYTES,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    GrammarSpec,
    Kind,
    parse_gbnf,
    parse_json_schema,
    parse_response_format,
    schema_text,
)

CACHE_ENTRIES = 256
"""Compiled grammars (and refusals) kept per ``Grammars`` (per loaded model), all tenants."""

MAX_ERROR_CHARS = 600
"""llguidance's messages are cut to this in a 400 (a regex error quotes the pattern)."""

_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ",", "key_separator": ":",
    "coerce_one_of": False, "lenient": False}
"""llguidance's JSON options, as overrides: a schema's ``x-guidance`` cannot change them."""

# -- 2. compile (worker thread) -------------------------------------------------------------


def _llg() -> Any:
    import llguidance

    return llguidance


class Vocabulary:
    """A model's tokens as llguidance sees them: built once per loaded model (about 0.25 s for
    SmolLM2's 49152 tokens). End-of-generation tokens are all of llama.cpp's EOG set, so the
    mask allows each of them where the document may end."""

    def __init__(self, tokenizer: Any, n_vocab: int, eog_ids: Iterable[int],
                 owner: Any = None) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = int(n_vocab)
        self.words = (self.n_vocab + 31) // 32
        """int32 words in one mask row."""
        self.eog_ids = tuple(int(t) for t in eog_ids)
        self._owner = owner  # llguidance tokenizes through the llama.cpp vocab: keep it alive

    @classmethod
    def from_llama(cls, model: Any) -> Vocabulary:
        """From a loaded ``native.LlamaModel`` (or anything with its ``vocab`` pointer,
        ``n_vocab`` and ``eog_ids``)."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        eog = [int(t) for t in model.eog_ids]
        with warnings.catch_warnings():  # it calls llama_token_get_attr, once per token
            warnings.simplefilter("ignore", DeprecationWarning)
            tokenizer = lltokenizer_from_vocab(model.vocab, eos_token=eog or None)
        if tokenizer.vocab_size != model.n_vocab:
            raise ValueError(f"llguidance sees {tokenizer.vocab_size} tokens, llama.cpp "
                             f"{model.n_vocab}")
        return cls(tokenizer, model.n_vocab, tokenizer.eos_tokens, owner=model)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Vocabulary:
        """A GGUF's vocabulary only (llama.cpp's ``vocab_only``: no weights): tests, tools."""
        import llama_cpp as L

        from sokuji.llm import native

        native._quiet()
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise ValueError(f"llama.cpp could not load {path}")
        vocab = L.llama_model_get_vocab(model)
        n = L.llama_vocab_n_tokens(vocab)
        holder = _VocabOnly(model, vocab, n,
                            [t for t in range(n) if L.llama_vocab_is_eog(vocab, t)])
        return cls.from_llama(holder)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.tokenize_str(text))

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode_str(list(tokens)))

    def allocate(self, rows: int = 1) -> np.ndarray:
        """A mask array of ``rows`` rows (int32, C-contiguous), every token allowed."""
        return np.full((rows, self.words), -1, dtype=np.int32)


class _VocabOnly:
    def __init__(self, model: Any, vocab: Any, n_vocab: int, eog_ids: list[int]) -> None:
        self.model, self.vocab, self.n_vocab, self.eog_ids = model, vocab, n_vocab, eog_ids

    def __del__(self) -> None:
        try:
            import llama_cpp as L

            L.llama_model_free(self.model)
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


class Compiled:
    """A grammar compiled for one vocabulary: hands out fresh matchers."""

    __slots__ = ("_template", "kind", "vocab")

    def __init__(self, template: Any, vocab: Vocabulary, kind: Kind) -> None:
        self._template = template
        self.vocab = vocab
        self.kind = kind

    def matcher(self) -> Matcher:
        """A matcher at the document's start (a copy of the pristine one: about 1 µs)."""
        return Matcher(self._template.deep_copy(), self.vocab)


class Grammars:
    """The compiler and its cache, one per loaded model. Thread-safe.

    The cache key is the tuple ``(tenant, kind, text)``: built from parts, so no client text
    can make two tenants' keys equal. Refusals are cached too (a repeated bad schema costs a
    lookup). At most ``max_entries`` entries, least recently used evicted first."""

    def __init__(self, vocab: Vocabulary, *, max_entries: int = CACHE_ENTRIES,
                 limits: Any = None) -> None:
        self.vocab = vocab
        self.max_entries = max_entries
        self._limits = limits
        """llguidance's ``LLParserLimits`` (fuel, grammar size, lexer states): its defaults,
        verbose errors off (``None``: that)."""
        self._cache: OrderedDict[tuple[str | None, str, str], Compiled | _Refusal] = (
            OrderedDict())
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    def cached(self, spec: GrammarSpec, tenant: str | None) -> Compiled | None:
        """The cached result without compiling (non-blocking: for the event loop); ``None``
        when it is not there. A cached refusal is raised again (naming this spec's field)."""
        key = (tenant, spec.kind, spec.text)
        with self._lock:
            found = self._cache.get(key)
            if found is None:
                return None
            self._cache.move_to_end(key)
            self.hits += 1
        if isinstance(found, _Refusal):
            raise found.error(spec)
        return found

    def compile(self, spec: GrammarSpec, tenant: str | None) -> Compiled:
        """The compiled grammar, from the cache or built now (blocking: call it on a worker
        thread). Raises ``InvalidInput`` naming ``spec.param`` for whatever llguidance
        cannot enforce or does not understand."""
        hit = self.cached(spec, tenant)
        if hit is not None:
            return hit
        key = (tenant, spec.kind, spec.text)
        try:
            result: Compiled | _Refusal = self._build(spec)
        except _Refusal as refusal:
            result = refusal.with_traceback(None)  # cached: keep no frames alive
        with self._lock:
            self.misses += 1
            self._cache[key] = result
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        if isinstance(result, _Refusal):
            raise result.error(spec) from None
        return result

    async def acompile(self, spec: GrammarSpec, tenant: str | None) -> Compiled:
        """``compile`` for the event loop: a cache hit answers at once, a miss is built on a
        worker thread (``asyncio.to_thread``), so the loop never waits for llguidance."""
        hit = self.cached(spec, tenant)
        if hit is not None:
            return hit
        return await asyncio.to_thread(self.compile, spec, tenant)

    def _build(self, spec: GrammarSpec) -> Compiled:
        llg = _llg()
        if spec.kind == "json_schema":
            try:
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.text,
                                                                 overrides=_JSON_OPTIONS)
            except ValueError as exc:
                raise _Refusal("the JSON schema is not valid", str(exc)) from None
            what = "the JSON schema cannot be enforced"
        elif spec.kind == "lark":
            what = "the tool-call grammar cannot be enforced"
            try:
                grammar = llg.LLMatcher.grammar_from_lark(spec.text)
            except ValueError as exc:
                raise _Refusal(what, str(exc)) from None
        else:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            what = "the GBNF grammar is not valid"
            try:
                lark = gbnf_to_lark(spec.text)
            except RecursionError:
                raise _Refusal(what, "it nests too deeply") from None
            except Exception as exc:  # noqa: BLE001 (GbnfToLarkError, or a bare Exception)
                raise _Refusal(what, str(exc)) from None
            grammar = llg.LLMatcher.grammar_from_lark(lark)
        limits = self._limits or llg.LLParserLimits(verbose_errors=False)
        template = llg.LLMatcher(self.vocab.tokenizer, grammar, log_level=0, limits=limits)
        if template.is_error():
            raise _Refusal(what, template.get_error())
        compiled = Compiled(template, self.vocab, spec.kind)
        problem = _probe(compiled.matcher(), self.vocab)
        if problem:
            subject = {"json_schema": "the JSON schema", "gbnf": "the GBNF grammar"}.get(
                spec.kind, "the tool-call grammar")
            raise _Refusal(f"{subject} fails at its first steps", problem)
        return compiled


PROBE_STEPS = 8
"""Steps of a deterministic walk tried at compile time (see ``_probe``)."""


def _probe(matcher: Matcher, vocab: Vocabulary) -> str | None:
    """Walk the first ``PROBE_STEPS`` steps (each time the lowest allowed token that is not
    end-of-generation) and return the error a step hit, if any. llguidance builds its parser
    rows lazily, so a grammar can compile and then fail at its first steps (1500 optional
    properties: ``Current row has 5999 items; max is 2000``, right after ``{``): such a
    grammar is a 400, not a sequence that fails in the engine. A heuristic: a grammar that
    blows up only deeper in is still caught by the engine (``Matcher.error``)."""
    mask = vocab.allocate(1)[0]
    eog = np.asarray(vocab.eog_ids, dtype=np.int64)
    for _ in range(PROBE_STEPS):
        if matcher.done:
            return None
        if not matcher.fill(mask):
            return matcher.error
        allowed = allowed_tokens(mask, vocab.n_vocab)
        allowed = allowed[~np.isin(allowed, eog)]
        if not len(allowed):
            return None  # only the end may follow
        if not matcher.consume(int(allowed[0])):
            return matcher.error
    return None


class _Refusal(Exception):
    """Why a grammar is refused: cached, and turned into the 400 for each request's field."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(what)
        detail = detail.strip()
        if len(detail) > MAX_ERROR_CHARS:
            detail = detail[:MAX_ERROR_CHARS - 3] + "..."
        self.what, self.detail = what, detail

    def error(self, spec: GrammarSpec) -> InvalidInput:
        return InvalidInput(f"{spec.param}: {self.what}: {self.detail}", param=spec.param)


# -- 3. per sequence (engine thread) --------------------------------------------------------


class Matcher:
    """One sequence's place in its grammar. Not thread-safe: one engine thread drives it."""

    __slots__ = ("_error", "_m", "vocab")

    def __init__(self, matcher: Any, vocab: Vocabulary) -> None:
        self._m = matcher
        self.vocab = vocab
        self._error: str | None = None

    def fill(self, mask: np.ndarray) -> bool:
        """Write the tokens allowed at the next position into ``mask`` (int32, C-contiguous,
        ``vocab.words`` words: one row). False when none is allowed (``error`` then says
        why); the engine ends the sequence."""
        _check_row(mask, self.vocab.words)
        self._m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return self._after_fill(mask)

    def _after_fill(self, row: np.ndarray) -> bool:
        if self._error is not None or self._m.is_error():
            return False
        if not row.any():
            self._error = self._error or "no token is allowed by the grammar"
            return False
        return True

    def consume(self, token: int) -> bool:
        """Advance past the sampled token. False: it was not allowed, or the grammar failed
        (``error`` says which); the matcher stays failed."""
        if self._error is not None:
            return False
        return bool(self._m.consume_token(int(token)))

    def rollback(self, n: int) -> bool:
        """Undo the last ``n`` consumed tokens (speculative decoding's rejected drafts)."""
        return bool(self._m.rollback(int(n)))

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar accepts in a row, without consuming."""
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    @property
    def done(self) -> bool:
        """The document is complete and nothing may follow (finish reason ``"stop"``)."""
        return self._error is None and not self._m.is_error() and bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """The document may end here: the mask holds the end-of-generation tokens."""
        return self._error is None and bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on, or ``None``."""
        if self._error is not None:
            return self._error
        if self._m.is_error():
            text = str(self._m.get_error()).split("\n", 1)[0]
            return _STOP_WORDS.get(text, text) or "grammar error"
        return None

    @property
    def stop_reason(self) -> str:
        """llguidance's: ``NotStopped``, ``NoExtension`` (complete), ``EndOfSentence`` (an
        EOG token was consumed), ``ParserTooComplex``, ``LexerTooComplex``..."""
        return str(self._m.stop_reason())


_STOP_WORDS = {
    "NoExtension": "no token can continue the output (the grammar may describe no text)",
    "NoExtensionBias": "no token can continue the output (the grammar may describe no text)",
    "ParserTooComplex": "the grammar's parser ran past its limits at this step",
    "LexerTooComplex": "the grammar's lexer ran past its limits at this step",
}
"""llguidance stop reasons that arrive as a bare error text, in words."""

_executor: Any = None
_executor_lock = threading.Lock()
FILL_THREADS = 1
"""llguidance threads for ``fill_many`` (llama.cpp holds the other cores while it decodes)."""


def fill_many(rows: Sequence[tuple[Matcher, int]], masks: np.ndarray) -> list[bool]:
    """``Matcher.fill`` for several sequences in one call (one GIL hand-off per engine step):
    ``rows`` pairs each matcher with its row of ``masks`` (int32, shape ``(rows, words)``,
    C-contiguous; a row index may not repeat). Returns ``fill``'s answer per pair."""
    global _executor
    if not rows:
        return []
    vocab = rows[0][0].vocab
    if any(m.vocab is not vocab for m, _ in rows):
        raise ValueError("fill_many takes the matchers of one vocabulary (one model)")
    words = vocab.words
    if (masks.dtype != np.int32 or masks.ndim != 2 or masks.shape[1] != words
            or not masks.flags["C_CONTIGUOUS"]):
        raise ValueError(f"masks must be C-contiguous int32 of shape (n, {words})")
    index = [int(i) for _, i in rows]
    if len(set(index)) != len(index) or min(index) < 0 or max(index) >= masks.shape[0]:
        raise ValueError("each matcher needs its own row of masks")
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = _llg().LLExecutor(num_threads=FILL_THREADS)
    _executor.unsafe_compute_mask_ptr([(m._m, i) for m, i in rows], masks.ctypes.data,
                                      words * 4, masks.shape[0])
    return [m._after_fill(masks[i]) for m, i in rows]


def _check_row(mask: np.ndarray, words: int) -> None:
    if mask.dtype != np.int32 or mask.size != words or not mask.flags["C_CONTIGUOUS"]:
        raise ValueError(f"a mask row must be {words} C-contiguous int32 words")


def allowed_tokens(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """The token ids a mask row allows (tests, debugging)."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little",
                         count=n_vocab)
    return np.flatnonzero(bits)
