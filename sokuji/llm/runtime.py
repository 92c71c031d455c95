"""Runtime ``llama``: a GGUF model served by the continuous-batching engine.

Its options (``[models.options]``): ``options.py``.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.errors import ConfigError
from sokuji.llm.options import LlamaOptions

if TYPE_CHECKING:
    from sokuji.llm.engine import GenerationEngine
    from sokuji.llm.prompt import PromptBuilder

log = logging.getLogger(__name__)
SMOLLM2 = "smollm2"


def default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


class LlamaRuntime:
    """Loads the GGUF and builds its prompt rules and engine (not an encoder ``Runtime``:
    ``llm/generator.py`` serves it under the model contract)."""

    close_wait_s = 10.0
    """How long ``close`` waits for prompt tokenisations in flight (each is bounded by the
    prompt's size check: tens of milliseconds) before giving up on freeing the model."""

    def __init__(self, name: str, path: str | None, options: LlamaOptions,
                 cache_dir: str, max_queue_depth: int, priority_aging_ms: float,
                 max_concurrency: int = 0, *, at: str) -> None:
        """``options``: as the kind checked them when the config loaded (``path`` None: the
        built-in smollm2); ``at``: where the model sits in the config (``models[1]``), named
        by the errors only loading finds."""
        from sokuji.llm import native

        if path is None and name != SMOLLM2:
            raise ValueError(f"{name}: a llama model other than the built-in smollm2 needs "
                             "a GGUF path")
        self.options = options
        self.at = at
        self.name = name
        self.source = native.smollm2_path() if path is None else Path(path)
        self.cache_dir = cache_dir
        self.max_queue_depth = max_queue_depth
        self.priority_aging_ms = priority_aging_ms
        self.max_concurrency = max_concurrency
        self.engine: GenerationEngine = None  # type: ignore[assignment]  # set by load()
        self.chat: Any = None
        self.model: Any = None
        self.draft: Any = None
        self.prompts: PromptBuilder = None  # type: ignore[assignment]  # set by load()
        """``llm.prompt.PromptBuilder``: request text -> prompt tokens within the limits."""
        self._grammars: Any = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars_ready(self) -> Any:
        """The model's grammar compiler and cache (``llm/grammar.Grammars``) once built, else
        None (non-blocking: for the event loop)."""
        return self._grammars

    def grammars(self) -> Any:
        """The model's ``Grammars``, built the first time a request needs one (its
        vocabulary read from llama.cpp: about half a second; blocking, call it in a worker
        thread)."""
        with self._grammars_lock:
            if self._grammars is None:
                from sokuji.llm.grammar import Grammars, Vocabulary

                self._grammars = Grammars(Vocabulary.from_llama(self.model))
            return self._grammars

    def load(self) -> None:
        from sokuji.llm import native
        from sokuji.llm.chat import ChatTemplate
        from sokuji.llm.engine import EngineConfig, GenerationEngine
        from sokuji.llm.prompt import PromptBuilder

        o = self.options
        path = native.requantized(self.source, o.requantize, self.cache_dir,
                                  key=f"{self.at}.options.requantize")
        shape = native.ContextShape(slots=o.slots, context_size=o.context_size,
                                    n_batch=o.n_batch, threads=o.threads or default_threads(),
                                    flash_attn=o.flash_attn)
        self.model = native.LlamaModel(path, shape, key=f"{self.at}.path")
        draft = self._load_draft(shape) if o.speculative == "draft" else None
        self.chat = ChatTemplate(o.chat_template or self.model.chat_template,
                                 self.model.bos, self.model.eos)
        self.prompts = PromptBuilder(self.name, self.model, self.chat, o)
        self.engine = GenerationEngine(self.name, self.model, EngineConfig.from_options(
            o, self.max_queue_depth, self.priority_aging_ms, self.max_concurrency), draft)

    def _load_draft(self, shape: Any) -> Any:
        """The draft model, in a context of the same shape; refused unless its vocabulary
        is the served model's, token for token."""
        from sokuji.llm import native

        o, key = self.options, f"{self.at}.options"
        source = Path(o.draft_model) if o.draft_model else self.source
        path = native.requantized(source, o.draft_requantize, self.cache_dir,
                                  key=f"{key}.draft_requantize")
        draft = native.LlamaModel(path, shape, key=f"{key}.draft_model")
        differs = native.vocab_difference(self.model, draft)
        if differs:
            draft.close()
            raise ConfigError.for_key(f"{key}.draft_model", str(source),
                                      f"its vocabulary differs from the served model's "
                                      f"({differs}): a draft model must share the tokenizer")
        self.draft = draft
        return draft

    def warmup(self) -> None:
        self.engine.warmup()

    def describe(self) -> ModelMetadata:
        return ModelMetadata(platform="llama.cpp",
                             inputs=(TensorSpec("text_input", "BYTES", (1,)),),
                             outputs=(TensorSpec("text_output", "BYTES", (1,)),))

    def close(self) -> None:
        """Free the model once no prompt is being tokenised (new ones get 503 from now on).
        Call it after the engine stopped. If a tokenisation is still running after
        ``close_wait_s``, the model is left allocated until the process exits: freeing the
        vocabulary under a running ``llama_tokenize`` would be a use-after-free."""
        if self.model is None:
            return
        if self.prompts is not None and not self.prompts.calls.close(self.close_wait_s):
            log.error("model %s: %d prompt tokenisation(s) still running after %.0f s; the "
                      "model is not freed", self.name, self.prompts.calls.in_flight,
                      self.close_wait_s)
            return
        self.model.close()
        self.model = None
        if self.draft is not None:
            self.draft.close()
            self.draft = None
