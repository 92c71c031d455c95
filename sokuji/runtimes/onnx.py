"""ONNX Runtime adapter for text encoders: ``tokenizers`` in, one embedding per text out.

The graph takes ``input_ids``, ``attention_mask`` and (if it declares it) ``token_type_ids``,
int64 ``[batch, sequence]``, and returns ``[batch, dim]``. Requests are tokenised one by one
before queueing (no padding); ``run_batch`` pads the whole batch once, to its longest item.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.errors import ConfigError, RuntimeFailed
from sokuji.runtimes.base import ModelMetadata, Prepared, TensorSpec

INPUT_NAME = "text"
OUTPUT_NAME = "embedding"


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

    def load(self) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(self.tokenizer_path))
        except Exception as exc:
            raise ConfigError.for_key("tokenizer", str(self.tokenizer_path),
                                      f"cannot load: {exc}") from exc
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self.max_sequence_length)
        self._tokenizer = tokenizer

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
            raise ConfigError.for_key("path", str(self.model_path),
                                      f"expected inputs input_ids and attention_mask, got {names}")
        self._input_names = names
        output = self._session.get_outputs()[0]
        self._output_name = output.name
        last = output.shape[-1] if output.shape else None
        self._dim = last if isinstance(last, int) else -1

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
        assert self._tokenizer is not None, "load() first"
        if len(texts) == 1:
            ids = [np.asarray(self._tokenizer.encode(texts[0]).ids, dtype=np.int64)]
        else:
            ids = [np.asarray(e.ids, dtype=np.int64)
                   for e in self._tokenizer.encode_batch(list(texts))]
        lengths = [len(x) for x in ids]
        return Prepared(data=ids, num_items=len(ids), length=max(lengths),
                        num_tokens=sum(lengths))

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
        self._session = None
