"""The options of runtime ``llama`` (``LlamaOptions.parse``: checked when the model is built).

Options (``[models.options]``), all optional:

- ``slots`` (8): sequences decoded together; ``context_size`` (2048): KV cells per sequence;
- ``threads`` (0: all cores allowed to the process but one, at least one — llama.cpp slows
  10-40x when its threads compete with any other busy thread);
- ``n_batch`` (512): most tokens in one ``llama_decode``; ``prefill_chunk`` (128): prompt
  tokens per step while other sequences decode;
- ``max_prompt_tokens`` (0: ``context_size`` - 1), ``max_new_tokens`` (1024);
- ``prefix_cache_mb`` (256; 0 turns the prefix cache off), ``prefix_cache_min_tokens`` (16);
- ``requantize`` ("" or "q8_0"): serve a requantized copy, made once into the cache dir.
  Off by default: SmolLM2's Q4_1 gets no fast batched kernel on these CPUs, and a Q8_0 copy
  prefills ~1.5x faster and batches better, but its greedy text differs from the shipped
  file's after a few dozen tokens on most prompts (rounding, not quality: measured in
  BENCHMARKS.md). Output is not traded for speed without the user asking;
- ``chat_template``: a Jinja template to use instead of the GGUF's own;
- ``split_small_batches`` (true): decode a pure-decode batch row by row whenever that measured
  cheaper than decoding it together (llama.cpp's 2-row Q8_0 step); false always batches
  (the choice depends on timing, so tests that count batching turn it off);
- ``flash_attn`` (true): llama.cpp's fused attention; ~25% more tokens/s at 8 sequences here.
  It changes the arithmetic slightly: greedy text equals llama.cpp's own only with the same
  setting (llama-cpp-python's ``Llama`` defaults to off);
- ``speculative`` ("ngram"): speculative decoding of greedy requests (``speculative.py``):
  "off", "ngram" (prompt lookup: drafts copied from the request's own context), or "draft"
  (a draft model proposes); ``speculative_tokens`` (8): draft tokens per sequence and step,
  at most; ``speculative_ngram_max`` / ``_min`` (16 / 2): the n-gram lengths looked up
  (the longest match wins; its length also tells how far to trust it);
  ``speculative_adaptive`` (true): draft only when the measured step costs and acceptance
  say it pays (false: always, for tests and benchmarks of the mechanism). Needs
  ``flash_attn``: with it a token's logits are the same whether 1 or up to 63 tokens of its
  sequence are decoded together (measured bit-equal); without it they differ from 2 on;
- ``draft_model`` (""): the draft model's GGUF (same vocabulary, checked at load; "": the
  served file itself), ``draft_requantize`` ("", "q4_0", "q8_0"): served requantized.
  ``speculative = "draft"`` needs one of the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from sokuji.errors import ConfigError

SPECULATIVE_MODES = ("off", "ngram", "draft")


@dataclass(frozen=True)
class LlamaOptions:
    slots: int = 8
    context_size: int = 2048
    threads: int = 0
    n_batch: int = 512
    prefill_chunk: int = 128
    max_prompt_tokens: int = 0
    max_new_tokens: int = 1024
    prefix_cache_mb: int = 256
    prefix_cache_min_tokens: int = 16
    requantize: str = ""
    chat_template: str = ""
    flash_attn: bool = True
    split_small_batches: bool = True
    speculative: str = "ngram"
    speculative_tokens: int = 8
    speculative_ngram_max: int = 16
    speculative_ngram_min: int = 2
    speculative_adaptive: bool = True
    draft_model: str = ""
    draft_requantize: str = ""

    @classmethod
    def parse(cls, raw: Mapping[str, Any], prefix: str) -> LlamaOptions:
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in kinds:
                raise ConfigError.for_key(f"{prefix}.{key}", value, "unknown option for runtime "
                                          f"llama; known: {', '.join(sorted(kinds))}")
            want = {"str": str, "bool": bool}.get(str(kinds[key]), int)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ConfigError.for_key(f"{prefix}.{key}", value, f"must be {want.__name__}")
            values[key] = value
        opts = cls(**values)
        for key in ("slots", "context_size", "n_batch", "prefill_chunk", "max_new_tokens",
                    "prefix_cache_min_tokens", "speculative_tokens", "speculative_ngram_min"):
            if getattr(opts, key) < 1:
                raise ConfigError.for_key(f"{prefix}.{key}", getattr(opts, key),
                                          "must be at least 1")
        for key in ("threads", "max_prompt_tokens", "prefix_cache_mb"):
            if getattr(opts, key) < 0:
                raise ConfigError.for_key(f"{prefix}.{key}", getattr(opts, key),
                                          "must be zero or more")
        if opts.requantize not in ("", "q8_0"):
            raise ConfigError.for_key(f"{prefix}.requantize", opts.requantize,
                                      'must be "" (as shipped) or "q8_0"')
        opts._check_speculative(prefix)
        if opts.speculative != "off" and not opts.flash_attn:
            if "speculative" in raw:
                raise ConfigError.for_key(f"{prefix}.speculative", opts.speculative,
                                          "needs flash_attn = true: without it llama.cpp "
                                          "computes a token differently when others of its "
                                          "sequence are in the same batch, so drafts could "
                                          "change the text")
            opts = replace(opts, speculative="off")  # (the default gives way)
        if opts.slots > 64:
            raise ConfigError.for_key(f"{prefix}.slots", opts.slots, "must be at most 64")
        if opts.n_batch < opts.slots:
            raise ConfigError.for_key(f"{prefix}.n_batch", opts.n_batch,
                                      f"must be at least slots ({opts.slots}): every step "
                                      "carries one token of each sequence")
        return opts

    def _check_speculative(self, prefix: str) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise ConfigError.for_key(f"{prefix}.speculative", self.speculative,
                                      f"must be one of: {', '.join(SPECULATIVE_MODES)}")
        if self.speculative_tokens > 32:  # 1 + 32 tokens a sequence: under llama.cpp's 64
            raise ConfigError.for_key(f"{prefix}.speculative_tokens", self.speculative_tokens,
                                      "must be at most 32")
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ConfigError.for_key(f"{prefix}.speculative_ngram_max",
                                      self.speculative_ngram_max, "must be at least "
                                      f"speculative_ngram_min ({self.speculative_ngram_min})")
        if self.draft_requantize not in ("", "q4_0", "q8_0"):
            raise ConfigError.for_key(f"{prefix}.draft_requantize", self.draft_requantize,
                                      'must be "", "q4_0" or "q8_0"')
        drafted = bool(self.draft_model or self.draft_requantize)
        if self.speculative == "draft" and not drafted:
            raise ConfigError.for_key(f"{prefix}.speculative", self.speculative,
                                      "needs draft_model (a smaller GGUF with the same "
                                      "vocabulary) or draft_requantize")
        if drafted and self.speculative != "draft":
            key = "draft_model" if self.draft_model else "draft_requantize"
            raise ConfigError.for_key(f"{prefix}.{key}", getattr(self, key),
                                      'is used only with speculative = "draft"')

    @property
    def prompt_limit(self) -> int:
        return min(self.max_prompt_tokens or self.context_size - 1, self.context_size - 1)
