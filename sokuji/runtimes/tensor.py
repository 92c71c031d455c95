"""ONNX Runtime for any graph: named tensors in, named tensors out, as the graph declares them.

``TensorRuntime`` loads one ONNX file into a session, reads its inputs and outputs (names,
element types, shapes: a symbolic or unknown dimension is -1) and runs batches of requests:

- **Batched** (``batched``: every input's first dimension is the batch's): the requests'
  inputs are concatenated along axis 0 and every output split back along it, in order, each
  request getting its own rows. Requests batched together have the same shapes past the batch
  dimension (``TensorModel`` groups them), except inputs declared ``ragged``: those are padded
  to the longest of the batch with their pad value, and the ``cut`` outputs are cut back to
  each request's own extent on those axes (a transformer's ``last_hidden_state``).
- **Unbatched** (Triton's ``max_batch_size = 0``): each request runs alone, as sent. A graph
  is batchable only when every input and every output leads with a dynamic dimension (an
  output of fixed or no first dimension cannot be split back by rows).
- **Failures.** A batch the graph fails on is run again one request at a time, so one
  request's values (an index past a table) fail only that request: it gets ``InputFailed``
  (422) once the graph has computed some input (its warm-up, an earlier request), and
  ``RuntimeFailed`` (500) before that, when the fault may as well be the model's. An output
  that does not have the batch's rows fails the batch (``RuntimeFailed``), never a wrong
  split.

Element types: every KServe V2 datatype maps to one ONNX tensor type (``V2_OF_ORT``); BYTES is
an ONNX string tensor (``str`` elements; raw bytes are decoded as UTF-8). A scikit-learn
classifier's ``seq(map(K, float))`` output (skl2onnx's ZipMap) is served as a dense FP32
tensor ``[batch, classes]``, columns in the order of the sorted class labels. Other non-tensor
types (sequences, optional) and types V2 lacks (bfloat16, float8) stop the load, naming them.

``run_batch`` is called in a worker thread (ONNX Runtime releases the GIL while it computes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.request import Prepared
from sokuji.core.tensor import BYTES, DTYPES
from sokuji.errors import ConfigError, InputFailed, RuntimeFailed, SokujiError

V2_OF_ORT = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64", "tensor(int8)": "INT8",
    "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": BYTES}
"""ONNX Runtime's type strings -> KServe V2 datatypes."""
ZIPMAP = "seq(map("
"""skl2onnx's ZipMap output type prefix: ``seq(map(int64,tensor(float)))``."""

__all__ = ["V2_OF_ORT", "Failed", "GraphTensor", "Options", "TensorRuntime"]


@dataclass(frozen=True)
class Failed:
    """One request's result in a batch where the graph failed on that request alone: its
    error, raised when the result is read (``TensorModel.to_tensors``), so the batch's other
    requests still get their answers."""

    error: SokujiError


@dataclass(frozen=True)
class GraphTensor:
    """One input or output as the graph declares it."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    """-1 for a symbolic or unknown dimension; ``()`` for a scalar."""
    zipmap: bool = False
    """An output of ``seq(map(K, float))``: served as dense FP32 ``[batch, classes]``."""
    optional: bool = False
    """An input the graph has a default for (an overridable initializer)."""


@dataclass(frozen=True)
class Options:
    """How a session is built and batches are run (the tensor kind's options, plain)."""

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    graph_optimization_level: str = "all"
    """disable, basic, extended, all (ONNX Runtime's levels)."""
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    ragged: Mapping[str, float] = field(default_factory=dict)
    """Inputs whose dimensions past the batch may differ between requests: padded to the
    batch's largest with this value."""
    cut: tuple[str, ...] = ()
    """Outputs cut back, on the ragged inputs' axes, to each request's own extent."""


_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
           "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


class TensorRuntime:
    def __init__(self, path: str | Path, options: Options = Options(),
                 batched: bool | None = None) -> None:
        self.path = Path(path)
        self.options = options
        self._batched_wanted = batched
        """None: batched if every input's first dimension is dynamic."""
        self.batched = False
        self.inputs: tuple[GraphTensor, ...] = ()
        self.outputs: tuple[GraphTensor, ...] = ()
        self._session: Any = None
        self._output_names: list[str] = []
        self._proven = False
        """The graph has computed some input: a failure now is that input's (422)."""

    # -- loading ---------------------------------------------------------------------------

    def load(self) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.options.intra_op_threads
        opts.inter_op_num_threads = self.options.inter_op_threads
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel,
                                                _LEVELS[self.options.graph_optimization_level])
        # Spinning threads steal the core that the event loop needs between batches.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._session = ort.InferenceSession(str(self.path), opts,
                                                 providers=list(self.options.providers))
        except Exception as exc:
            raise ConfigError.for_key("path", str(self.path),
                                      f"ONNX Runtime cannot load it: {exc}") from exc
        # (Overridable initializers are weights, not inputs: not served, as Triton's
        # onnxruntime backend does not serve them.)
        self.inputs = tuple(_graph_tensor(i, "input") for i in self._session.get_inputs())
        self.outputs = tuple(_graph_tensor(o, "output") for o in self._session.get_outputs())
        if not self.inputs:
            raise ConfigError.for_key("path", str(self.path), "the graph has no inputs")
        dynamic = all(t.shape and t.shape[0] == -1 for t in (*self.inputs, *self.outputs))
        if self._batched_wanted and not dynamic:
            fixed = next(t for t in (*self.inputs, *self.outputs)
                         if not t.shape or t.shape[0] != -1)
            raise ConfigError.for_key(
                "max_batch_size", "at least 1",
                f"'{fixed.name}' has shape {list(fixed.shape)}: its first dimension is "
                "not a dynamic batch dimension, so requests cannot be batched along it; set "
                "max_batch_size = 0 to serve it unbatched")
        self.batched = dynamic if self._batched_wanted is None else self._batched_wanted
        for name in self.options.ragged:
            if name not in {t.name for t in self.inputs}:
                raise ConfigError.for_key("options.ragged", name, "the graph has no such input")
        for name in self.options.cut:
            if name not in {t.name for t in self.outputs}:
                raise ConfigError.for_key("options.cut", name, "the graph has no such output")
        self._output_names = [o.name for o in self.outputs]

    def describe(self, platform: str = "onnxruntime_onnx") -> ModelMetadata:
        """The graph's inputs and outputs as V2 tensors; a batched model's first dimension
        is -1 (any batch)."""
        def spec(t: GraphTensor) -> TensorSpec:
            shape = t.shape
            if self.batched and shape:
                shape = (-1, *shape[1:])
            return TensorSpec(t.name, t.datatype, shape, optional=t.optional)

        return ModelMetadata(platform=platform, inputs=tuple(map(spec, self.inputs)),
                             outputs=tuple(map(spec, self.outputs)))

    def warmup(self, samples: Sequence[Mapping[str, np.ndarray]] = ()) -> None:
        """Run each sample (a request's inputs by name), or one made of zeros where every
        dynamic dimension is 1 (a graph whose shapes that breaks is warmed by its first
        request instead)."""
        for sample in samples or [self.zeros()]:
            try:
                self.run_one(dict(sample))
            except RuntimeFailed:
                if samples:
                    raise

    def zeros(self) -> dict[str, np.ndarray]:
        """Inputs of zeros (empty strings), every dynamic dimension 1."""
        out: dict[str, np.ndarray] = {}
        for t in self.inputs:
            if t.optional:
                continue
            shape = tuple(1 if d < 0 else d for d in t.shape)
            out[t.name] = np.full(shape, "", dtype=object) if t.datatype == BYTES \
                else np.zeros(shape, dtype=DTYPES[t.datatype])
        return out

    # -- running ---------------------------------------------------------------------------

    def run_one(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph on ``feeds`` as they are: every output, by name."""
        assert self._session is not None, "load() first"
        try:
            values = self._session.run(self._output_names, feeds)
        except Exception as exc:
            what = "the model failed on this input" if self._proven else "the model failed"
            error = InputFailed if self._proven else RuntimeFailed
            raise error(f"{what}: ONNX Runtime: {_ort_message(exc)}") from exc
        out = {o.name: _dense(o, v) for o, v in zip(self.outputs, values, strict=True)}
        self._proven = True
        return out

    def run_batch(self, batch: Sequence[Prepared]) -> list[dict[str, np.ndarray] | Failed]:
        """Each request's outputs (``Prepared.data``: its inputs by name, each with
        ``num_items`` rows when batched), in order."""
        if len(batch) == 1:
            return [self._cut(self.run_one(batch[0].data), batch[0].data)]
        if not self.batched:  # never formed (max_batch_size 1), but correct if it were
            return [self._alone(p) for p in batch]
        feeds = {t.name: self._concat(t.name, [p.data[t.name] for p in batch])
                 for t in self.inputs if t.name in batch[0].data}
        try:
            out = self.run_one(feeds)
        except SokujiError:  # whose values? each alone: only the culprit fails
            return [self._alone(p) for p in batch]
        total = sum(p.num_items for p in batch)
        for name, value in out.items():
            if value.ndim == 0 or value.shape[0] != total:
                raise RuntimeFailed(f"output '{name}' has shape {list(value.shape)} for a "
                                    f"batch of {total} rows: the graph does not keep the "
                                    "batch dimension (serve it with max_batch_size = 0)")
        results: list[dict[str, np.ndarray] | Failed] = []
        start = 0
        for p in batch:
            stop = start + p.num_items
            rows = {name: value[start:stop] for name, value in out.items()}
            results.append(self._cut(rows, p.data))
            start = stop
        return results

    def _alone(self, p: Prepared) -> dict[str, np.ndarray] | Failed:
        try:
            return self._cut(self.run_one(p.data), p.data)
        except SokujiError as exc:
            return Failed(exc)

    def _concat(self, name: str, parts: list[np.ndarray]) -> np.ndarray:
        pad = self.options.ragged.get(name)
        if pad is None or all(p.shape == parts[0].shape for p in parts):
            return np.concatenate(parts, axis=0)
        extent = tuple(max(p.shape[k] for p in parts) for k in range(1, parts[0].ndim))
        rows = sum(p.shape[0] for p in parts)
        out = np.full((rows, *extent), pad, dtype=parts[0].dtype)
        start = 0
        for p in parts:
            out[(slice(start, start + p.shape[0]), *(slice(0, d) for d in p.shape[1:]))] = p
            start += p.shape[0]
        return out

    def _cut(self, rows: dict[str, np.ndarray], inputs: Mapping[str, np.ndarray]
             ) -> dict[str, np.ndarray]:
        """The ``cut`` outputs back to this request's extent on the ragged axes."""
        if not self.options.cut:
            return rows
        ragged = next((inputs[n] for n in self.options.ragged if n in inputs), None)
        if ragged is None:
            return rows
        for name in self.options.cut:
            value = rows[name]
            axes = min(value.ndim, ragged.ndim)
            index = (slice(None), *(slice(0, ragged.shape[k]) for k in range(1, axes)))
            rows[name] = value[index]
        return rows

    def close(self) -> None:
        self._session = None


def _graph_tensor(node: Any, what: str) -> GraphTensor:
    kind = node.type
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (node.shape or ()))
    if kind in V2_OF_ORT:
        return GraphTensor(node.name, V2_OF_ORT[kind], shape)
    if what == "output" and kind.startswith(ZIPMAP) and kind.endswith("tensor(float)))"):
        return GraphTensor(node.name, "FP32", (-1, -1), zipmap=True)
    raise ConfigError.for_key("path", node.name,
                              f"{what} '{node.name}' has type {kind}, which KServe V2 cannot "
                              f"carry (supported: {', '.join(sorted(V2_OF_ORT))}; a "
                              "classifier's seq(map(K, float)) output)")


def _ort_message(exc: Exception) -> str:
    """ONNX Runtime's message without its source paths: ``[ONNXRuntimeError] : 2 :
    INVALID_ARGUMENT : Non-zero status code returned while running Gather node. ...``."""
    text = str(exc)
    return text if len(text) <= 600 else f"{text[:600]}..."


def _dense(spec: GraphTensor, value: Any) -> np.ndarray:
    """An output as a numpy array: a ZipMap's list of dicts as ``[rows, classes]``."""
    if not spec.zipmap:
        return np.asarray(value)
    if not value:
        return np.zeros((0, 0), dtype=np.float32)
    keys = sorted(value[0])
    return np.array([[row[k] for k in keys] for row in value], dtype=np.float32)
