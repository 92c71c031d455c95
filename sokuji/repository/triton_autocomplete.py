"""Triton's auto-complete for ONNX models: a model configuration without inputs or outputs
(or no config.pbtxt at all) completed from the graph, the way Triton's onnxruntime backend
does it (``ModelState::AutoCompleteConfig``).

- It runs only when the configuration lacks ``input`` or ``output``; a configuration that
  declares both is taken as it is, ``max_batch_size`` included (0 when left out).
- The graph can batch when every input and every output has a dynamic first dimension. Then
  a ``max_batch_size`` of 0 (or none) becomes the backend's default, 4 (Triton's
  ``default-max-batch-size``), and a model batching more than 1 gets an (empty)
  ``dynamic_batching`` when it names no scheduler. A graph that cannot batch with a
  ``max_batch_size`` set is refused, as Triton refuses it.
- Missing inputs / outputs are the graph's, in its order: datatype, dims past the batch
  dimension when batched; a tensor with no dims left is ``dims: [1]`` reshaped to ``[]``.

The graph is read with ONNX Runtime (``runtimes/tensor.py``'s loader: a classifier's ZipMap
output is the dense FP32 ``[batch, classes]`` Sokuji serves). Inputs the graph has a default
for (overridable initializers) are not listed, as Triton's backend does not list them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sokuji.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 4
"""Triton's ``--backend-config=default-max-batch-size`` default."""


def needed(config: Any) -> bool:
    """Whether Triton would auto-complete ``config`` (a ``ModelConfig`` proto)."""
    return not (len(config.input) + len(config.batch_input)) or not len(config.output)


def complete(config: Any, graph_file: Path, where: str) -> None:
    """Fill ``config`` (a ``model_config_pb2.ModelConfig``, in place) from the graph at
    ``graph_file``; ``where`` names the model in errors."""
    from tritonclient.grpc import model_config_pb2 as pb

    from sokuji.runtimes.tensor import Options, TensorRuntime

    runtime = TensorRuntime(graph_file, Options(graph_optimization_level="disable"))
    try:
        runtime.load()
    except ConfigError as exc:
        raise ConfigError(f"{where}: auto-complete cannot read the graph {graph_file}: "
                          f"{exc}") from exc
    try:
        inputs = [t for t in runtime.inputs if not t.optional]
        outputs = list(runtime.outputs)
    finally:
        runtime.close()
    can_batch = all(t.shape and t.shape[0] == -1 for t in inputs + outputs)
    if can_batch:
        if config.max_batch_size == 0:
            config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
            log.warning("%s: max_batch_size auto-completed to %d (the graph can batch and "
                        "the configuration sets none)", where, DEFAULT_MAX_BATCH_SIZE)
        if config.max_batch_size > 1 and config.WhichOneof("scheduling_choice") is None:
            config.dynamic_batching.SetInParent()
    elif config.max_batch_size != 0:
        raise ConfigError(f"{where}: auto-complete failed: the graph does not support "
                          f"batching (not every input and output has a dynamic first "
                          f"dimension) while max_batch_size = {config.max_batch_size}; set "
                          "max_batch_size: 0")
    skip = 1 if config.max_batch_size > 0 else 0
    if not len(config.input) and not len(config.batch_input):
        for t in inputs:
            _tensor(config.input.add(), t, skip, pb)
    if not len(config.output):
        for t in outputs:
            _tensor(config.output.add(), t, skip, pb)


def _tensor(io: Any, t: Any, skip: int, pb: Any) -> None:
    io.name = t.name
    io.data_type = pb.DataType.Value("TYPE_STRING" if t.datatype == "BYTES"
                                     else f"TYPE_{t.datatype}")
    dims = list(t.shape[skip:])
    if dims:
        io.dims.extend(dims)
    else:
        io.dims.append(1)
        io.reshape.SetInParent()  # shape [] (a scalar per batch item)
