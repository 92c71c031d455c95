"""Embedding a corpus outside the request path, batched the way the served model batches.

Some texts are embedded where no batcher can take them: a classifier's prototypes while it
loads (``runtimes/classifier.py``), a retrieval index built at start-up with the served
encoder's runtime, before its batcher is started (``pipelines/load.py``), and the offline
tools, ``sokuji index build``, the calibrations and the benchmarks, that load an encoder
without a server (``retrieval/builtin.py``). ``embed_corpus`` is the one way they all do it,
within the batcher's budgets and on its terms (``core/forming.py``): each text is prepared
alone, as one request's item is; texts are taken by token length, the order the length
policy seeks (little padding); a batch holds at most ``max_batch_size`` items and
``max_batch_tokens`` padded positions (items x the longest), and a text over the token
budget runs alone. A batch is one ``run_batch`` over its texts' ``Prepared``, as the
batcher hands the runtime its requests, so a text's embedding here is what serving it in
the same company computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from sokuji.config import ModelConfig
from sokuji.runtimes.base import Prepared, Runtime

_MODEL = ModelConfig(name="-")  # the batch budgets' defaults, declared once in the schema


def corpus_batches(prepared: Sequence[Prepared], max_batch_size: int,
                   max_batch_tokens: int) -> list[list[int]]:
    """Positions in ``prepared``, in batches: by ascending length (ties in input order), each
    batch within both budgets, or a single item over them. Every position is in one batch."""
    order = sorted(range(len(prepared)), key=lambda i: prepared[i].length)
    batches: list[list[int]] = []
    batch: list[int] = []
    items = longest = 0
    for i in order:
        p = prepared[i]
        new_items, new_longest = items + p.num_items, max(longest, p.length)
        if batch and (new_items > max_batch_size or new_items * new_longest > max_batch_tokens):
            batches.append(batch)
            batch, new_items, new_longest = [], p.num_items, p.length
        batch.append(i)
        items, longest = new_items, new_longest
    if batch:
        batches.append(batch)
    return batches


def embed_corpus(runtime: Runtime, texts: Sequence[str], *,
                 max_batch_size: int = _MODEL.max_batch_size,
                 max_batch_tokens: int = _MODEL.max_batch_tokens,
                 progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """float32 ``[n, dim]``: one row per text, in the texts' order (``[0, 0]`` for none),
    from a loaded ``runtime``. ``max_batch_size`` / ``max_batch_tokens``: the batch budgets
    of the model that will serve these embeddings' queries (default: the config's defaults).
    ``progress(done, total)`` after each batch. Runs in the calling thread."""
    prepared = [runtime.preprocess([text]) for text in texts]
    if not prepared:
        return np.zeros((0, 0), np.float32)
    batches = corpus_batches(prepared, max_batch_size, max_batch_tokens)
    parts: list[np.ndarray] = []
    done = 0
    for batch in batches:
        outputs = runtime.run_batch([prepared[i] for i in batch])
        parts.extend(np.asarray(o, dtype=np.float32) for o in outputs)
        done += len(batch)
        if progress is not None:
            progress(done, len(texts))
    out = np.empty((len(texts), parts[0].shape[1]), np.float32)
    out[np.asarray([i for batch in batches for i in batch])] = np.concatenate(parts)
    return out
