"""The options of runtime ``llama``: ``LlamaOptions``, the schema its kind
(``kinds/generator``) checks when the config loads; what relates one option to another
(``n_batch`` and ``slots``, speculation and its draft) is checked there too.

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
- ``max_n`` (8): the most choices (``n``) one request may ask for; the choices share the
  prompt's one prefill and take a slot each;
- ``draft_model`` (""): the draft model's GGUF (same vocabulary, checked at load; "": the
  served file itself), ``draft_requantize`` ("", "q4_0", "q8_0"): served requantized.
  ``speculative = "draft"`` needs one of the two.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from sokuji.config_types import AtLeast1, ZeroOrMore, _Table, _why


class LlamaOptions(_Table, frozen=True):
    slots: Annotated[int, Meta(ge=1, le=64)] = 8
    context_size: AtLeast1 = 2048
    threads: ZeroOrMore = 0
    n_batch: AtLeast1 = 512
    prefill_chunk: AtLeast1 = 128
    max_prompt_tokens: ZeroOrMore = 0
    max_new_tokens: AtLeast1 = 1024
    prefix_cache_mb: ZeroOrMore = 256
    prefix_cache_min_tokens: AtLeast1 = 16
    requantize: Annotated[Literal["", "q8_0"], _why('must be "" (as shipped) or "q8_0"')] = ""
    chat_template: str = ""
    flash_attn: bool = True
    split_small_batches: bool = True
    speculative: Literal["off", "ngram", "draft"] = "ngram"
    speculative_tokens: Annotated[int, Meta(ge=1, le=32)] = 8
    """At most 32: 1 + 32 tokens a sequence stay under llama.cpp's 64."""
    speculative_ngram_max: AtLeast1 = 16
    speculative_ngram_min: AtLeast1 = 2
    speculative_adaptive: bool = True
    max_n: Annotated[int, Meta(ge=1, le=128)] = 8
    draft_model: str = ""
    draft_requantize: Annotated[Literal["", "q4_0", "q8_0"],
                                _why('must be "", "q4_0" or "q8_0"')] = ""

    @property
    def prompt_limit(self) -> int:
        return min(self.max_prompt_tokens or self.context_size - 1, self.context_size - 1)
