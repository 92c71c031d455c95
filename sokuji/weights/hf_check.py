"""Checking an export against transformers before ``sokuji export`` hands it over
(``weights/hf_export.py``): the same sentences through transformers itself and through the
exported graph as the server runs it.

The check runs transformers (torch, the model's default attention) on ``SENTENCES`` (short,
long, non-Latin, empty, one past the model's window), each alone and unpadded, pools the
hidden states in NumPy as sentence-transformers does, and runs the exported graph through
``OnnxEncoderRuntime`` itself on the copied ``tokenizer.json`` (each alone, and those within
the window as one padded batch): the tokenizer, the padding and the truncation the server
uses. Embeddings must agree to a cosine of at least ``COSINE_TOLERANCE`` (every sentence,
alone and batched) and in length to ``NORM_TOLERANCE`` relative (a cosine cannot see a
missing or extra normalisation), logits to ``LOGITS_TOLERANCE`` absolute.

numpy, torch, transformers and the runtime are imported only inside the functions that check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sokuji.weights.hf_checkpoint import Checkpoint, load_model

COSINE_TOLERANCE = 0.9999
LOGITS_TOLERANCE = 1e-3
NORM_TOLERANCE = 1e-3

SENTENCES = (
    "The cat sat on the mat.",
    "Quarterly revenue rose 12% to $4.2 billion, beating analysts' estimates.",
    "How do I reset my password?",
    "東京は日本の首都です。",
    "ok",
    "",
    "Patient presented with acute dyspnea; SpO2 88% on room air, started on 2L O2 via NC.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Die Katze schläft auf dem Sofa, während draußen der Regen fällt.",
    # Past every window up to 512 tokens: both sides must truncate the same way.
    " ".join(["Retrieval-augmented generation grounds answers in documents."] * 64),
)


@dataclass
class Verdict:
    """What the check measured."""

    measure: str
    """``min cosine`` (embeddings) or ``max abs logits diff`` (classification)."""
    value: float
    tolerance: float
    sentences: int
    ok: bool
    dim: int
    inputs: list[str]
    """The graph's input names, in its order."""
    per_sentence: list[float] = field(default_factory=list)
    norm_diff: float | None = None
    """Embeddings: the largest relative difference of a vector's length."""

    def line(self) -> str:
        cosine = self.measure == "min cosine"
        shown = f"{self.value:.8f}" if cosine else f"{self.value:.3g}"
        cmp = ">=" if cosine else "<="
        norms = ("" if self.norm_diff is None else
                 f"; max relative norm diff = {self.norm_diff:.3g} (<= {NORM_TOLERANCE:g})")
        return (f"check: {self.measure} = {shown} over {self.sentences} sentences "
                f"(alone and batched; tolerance {cmp} {self.tolerance:g}{norms}): "
                + ("ok" if self.ok else "FAILED"))


def reference(ckpt: Checkpoint, sentences: Sequence[str]) -> Any:
    """transformers' own output for ``sentences``, each alone (no padding: the graph's
    padded batches are checked against it): its tokenizer truncating to the window, its
    model, the hidden states pooled in NumPy as sentence-transformers pools them."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(ckpt.tokenizer_json.parent if ckpt.tokenizer_json else ckpt.model_dir),
        local_files_only=True)
    model = load_model(ckpt)
    rows = []
    for text in sentences:
        enc = tokenizer([text], truncation=True, max_length=ckpt.max_length,
                        return_tensors="pt")
        with torch.no_grad():
            out = model(**enc)
        if ckpt.task == "classification":
            rows.append(out.logits.numpy()[0].astype(np.float64))
            continue
        hidden = out.last_hidden_state.numpy()[0].astype(np.float64)
        if ckpt.pooling == "cls":
            pooled = hidden[0]
        elif ckpt.pooling == "max":
            pooled = hidden.max(axis=0)
        else:
            pooled = hidden.mean(axis=0)
        if ckpt.normalize:
            pooled = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
        rows.append(pooled)
    return np.stack(rows)


def served(onnx_path: Path, tokenizer_path: Path, max_length: int,
           sentences: Sequence[str]) -> tuple[Any, Any, list[str], list[bool]]:
    """The exported graph through the server's own runtime: each of ``sentences`` alone,
    and those that fit the window with room to spare in one padded batch (the one past
    it is read alone: padded to the window, it would multiply the work for nothing the
    short ones do not show). Also the graph's input names."""
    import numpy as np

    from sokuji.runtimes.onnx import OnnxEncoderRuntime

    runtime = OnnxEncoderRuntime(onnx_path, tokenizer_path, max_sequence_length=max_length)
    runtime.load()
    try:
        prepared = [runtime.preprocess([s]) for s in sentences]
        alone = np.concatenate([runtime.run_batch([p])[0] for p in prepared])
        short = [s for s, p in zip(sentences, prepared, strict=True) if p.length < max_length]
        batched = (runtime.run_batch([runtime.preprocess(short)])[0] if short
                   else alone[:0])
        inputs = list(runtime._input_names)  # as the runtime read them from the graph
    finally:
        runtime.close()
    return batched, alone, inputs, [p.length < max_length for p in prepared]


def check(ckpt: Checkpoint, onnx_path: Path, tokenizer_path: Path,
          sentences: Sequence[str] = SENTENCES) -> Verdict:
    """Compare the exported graph (as served: batched and alone) with transformers (each
    sentence alone, unpadded) on ``sentences``."""
    import numpy as np

    ref = reference(ckpt, sentences)
    batched, alone, inputs, in_batch = served(onnx_path, tokenizer_path, ckpt.max_length,
                                              sentences)
    classify = ckpt.task == "classification"

    def compare(got: Any, want: Any) -> Any:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if classify:
            return np.abs(got - want).max(axis=1)
        a = got / np.maximum(np.linalg.norm(got, axis=1, keepdims=True), 1e-12)
        b = want / np.maximum(np.linalg.norm(want, axis=1, keepdims=True), 1e-12)
        return np.sum(a * b, axis=1)

    per = compare(alone, ref)
    mask = np.asarray(in_batch, dtype=bool)
    pick = np.maximum if classify else np.minimum
    per[mask] = pick(per[mask], compare(batched, ref[mask]))
    if classify:
        value = float(per.max())
        return Verdict("max abs logits diff", value, LOGITS_TOLERANCE, len(sentences),
                       value <= LOGITS_TOLERANCE, ref.shape[1], inputs, per.tolist())
    # A cosine cannot see a scale: the norms must agree too (normalised or not, as declared).
    norms = np.linalg.norm(np.asarray(alone, np.float64), axis=1)
    want = np.linalg.norm(ref, axis=1)
    norm_diff = float((np.abs(norms - want) / np.maximum(want, 1e-12)).max())
    value = float(per.min())
    return Verdict("min cosine", value, COSINE_TOLERANCE, len(sentences),
                   value >= COSINE_TOLERANCE and norm_diff <= NORM_TOLERANCE, ref.shape[1],
                   inputs, per.tolist(), norm_diff)
