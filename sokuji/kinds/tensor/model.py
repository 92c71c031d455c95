"""A tensor model served under the model contract: any ONNX graph's named tensors in and out,
over a ``TensorRuntime`` and its own dynamic batcher (``BatchedModel``,
``kinds/encoder/model.py``).

- ``from_tensors`` checks each input against the model before anything is queued, and
  refuses with 400 naming the input, what it expects and what it got: the rank (a ``[N, 1]``
  tensor for a ``[-1]`` input is taken as ``[N]``, as Triton's clients send it), a
  zero-sized dimension, a batch over ``max_batch_size`` or batches that differ between the
  inputs, BYTES that are not UTF-8. (Datatype, names, fixed dimensions and the data's size
  against its shape are checked by the V2 codec, ``server/v2.py``, against ``metadata``.)
  A declared ``reshape`` (Triton's) is applied here: the graph gets its own shape.
- ``prepare`` makes the ``Prepared`` the batcher groups by: ``num_items`` the batch rows (1
  unbatched), ``length`` the elements of one row (the batch's element budget and the cost
  of running alone on the event loop are in elements), ``group`` the shapes past the batch
  dimension, so requests of other shapes never share a batch (a ``ragged`` input counts only
  its rank: it is padded).
- ``to_tensors`` gives every output the graph computed, NaN and Inf as they are, in the
  model's order (the codec sends those the request asked for); a declared output
  ``reshape`` is applied back. A request the graph failed on inside a batch (its batch
  mates answered) raises its own error here (``runtimes/tensor.py``'s ``Failed``).
- ``identity`` (the response cache): each input's name, datatype, shape and a SHA-256 of its
  bytes, so two requests share an answer only for the same tensors.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sokuji.core.limits import Limit
from sokuji.core.model import Api, ModelMetadata, Report, RequestContext
from sokuji.core.request import Prepared
from sokuji.core.tensor import BYTES, InferRequest, Tensor
from sokuji.errors import InvalidInput
from sokuji.kinds.encoder.model import BatchedModel
from sokuji.runtimes.tensor import Failed

INFER = frozenset({Api.INFER})


@dataclass(frozen=True)
class Shapes:
    """How the model's served tensors relate to the graph's (plain; ``kind.py`` makes it)."""

    max_batch_size: int
    """0: unbatched (each request as the graph takes it)."""
    ragged: frozenset[str] = frozenset()
    input_reshape: Mapping[str, tuple[int, ...]] | None = None
    """Input name -> the graph's shape past the batch dimension, where it differs."""
    output_reshape: Mapping[str, tuple[int, ...]] | None = None
    """Output name -> the served shape past the batch dimension, where it differs."""


class TensorModel(BatchedModel):
    """``runtime``: a ``TensorRuntime`` (loaded); ``metadata``: the served tensors."""

    def __init__(self, config: Any, runtime: Any, batcher: Any, metadata: ModelMetadata,
                 shapes: Shapes, limits: tuple[Limit, ...]) -> None:
        self.config = config
        self.runtime = runtime
        self.batcher = batcher
        self.apis = INFER
        self.limits = limits
        self.metadata = metadata
        self.shapes = shapes
        self.batches = shapes.max_batch_size > 0
        """Batched in Triton's sense (its configuration's ``max_batch_size`` and dims)."""
        self._elements = next(x for x in limits if x.key == "options.max_elements")
        self._specs = {t.name: t for t in metadata.inputs}
        self._out_specs = metadata.outputs
        self.triton_config: dict[str, Any] | None = None
        """The Triton model configuration it was served from, completed (a repository's)."""

    @property
    def batched(self) -> bool:
        return self.shapes.max_batch_size > 0

    def from_tensors(self, request: InferRequest) -> dict[str, np.ndarray]:
        feeds: dict[str, np.ndarray] = {}
        batch = None
        elements = 0
        for name, tensor in request.inputs.items():
            spec = self._specs[name]
            shape = tensor.shape
            if len(shape) == len(spec.shape) + 1 and shape[-1] == 1:
                shape = shape[:-1]  # [N, 1] for [-1]: Triton's clients send it so
            if 0 in shape:
                raise InvalidInput(f"input '{name}' has shape {list(tensor.shape)}: a "
                                   "dimension of size 0 (the model needs at least one "
                                   "element on each)", param=f"inputs.{name}.shape")
            if self.batched:
                rows = shape[0]
                if rows > self.shapes.max_batch_size:
                    raise InvalidInput(
                        f"input '{name}' has a batch of {rows} (shape {list(tensor.shape)}); "
                        f"this model takes at most max_batch_size = "
                        f"{self.shapes.max_batch_size}", param=f"inputs.{name}.shape")
                if batch is not None and rows != batch:
                    raise InvalidInput(f"input '{name}' has a batch of {rows}; the other "
                                       f"inputs have {batch}", param=f"inputs.{name}.shape")
                batch = rows
            elements += math.prod(shape)  # Python ints: ~30x cheaper than np.prod
            feeds[name] = self._array(name, tensor, shape)
        self._elements.check(elements, "the request's input elements")
        return feeds

    def _array(self, name: str, tensor: Tensor, shape: tuple[int, ...]) -> np.ndarray:
        if tensor.datatype == BYTES:
            try:
                items = [e.decode("utf-8") if isinstance(e, bytes) else e for e in tensor.data]
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"input '{name}' has an element that is not UTF-8 (byte "
                                   f"{exc.start}); the graph takes strings",
                                   param=f"inputs.{name}.data") from None
            array = np.array(items, dtype=object).reshape(shape)
        else:
            array = tensor.data.reshape(shape)
        graph = (self.shapes.input_reshape or {}).get(name)
        if graph is not None:
            lead = shape[:1] if self.batched else ()
            array = array.reshape((*lead, *graph))
        return array

    async def prepare(self, inputs: dict[str, np.ndarray], ctx: RequestContext) -> Prepared:
        first = next(iter(inputs.values()))
        rows = int(first.shape[0]) if self.batched and first.ndim else 1
        per_row = max(1, max(a.size for a in inputs.values()) // max(rows, 1))
        group = tuple((n, a.ndim if n in self.shapes.ragged else a.shape[1:])
                      for n, a in sorted(inputs.items())) if self.batched else None
        return Prepared(data=inputs, num_items=rows, length=per_row, num_tokens=0,
                        group=group)

    def to_tensors(self, result: dict[str, np.ndarray] | Failed, report: Report
                   ) -> list[Tensor]:
        if isinstance(result, Failed):  # the graph failed on this request (its batch ran)
            raise result.error
        out: list[Tensor] = []
        reshape = self.shapes.output_reshape or {}
        for spec in self._out_specs:
            value = result[spec.name]
            served = reshape.get(spec.name)
            if served is not None:
                lead = value.shape[:1] if self.batched else ()
                value = value.reshape((*lead, *served))
            if spec.datatype == BYTES:
                data: Any = [e if isinstance(e, (str, bytes)) else str(e)
                             for e in value.reshape(-1).tolist()]
            else:
                data = value
            out.append(Tensor(spec.name, spec.datatype, tuple(value.shape), data))
        return out

    def identity(self, inputs: dict[str, np.ndarray]) -> list[str] | None:
        if not self.config.cache:
            return None
        parts: list[str] = []
        for name, array in sorted(inputs.items()):
            h = hashlib.sha256()
            if array.dtype == object:
                for item in array.reshape(-1).tolist():
                    raw = str(item).encode("utf-8", "surrogatepass")
                    h.update(len(raw).to_bytes(8, "little"))
                    h.update(raw)
            else:
                h.update(np.ascontiguousarray(array).tobytes())
            parts += [name, str(array.dtype), repr(array.shape), h.hexdigest()]
        return parts
