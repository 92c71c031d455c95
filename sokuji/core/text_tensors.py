"""Texts as V2 tensors: the adapter of every model that takes one BYTES input of texts and
answers a row per text (encoders, classifiers, the routers and upstreams that serve like
them). Its texts are UTF-8; its rows go back as the one output tensor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sokuji.core.model import ModelMetadata
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.errors import InvalidInput, TooManyItems


def texts(request: InferRequest, meta: ModelMetadata, max_items: int) -> list[str]:
    """The request's texts: its one input's elements (``str``, or UTF-8 ``bytes``), at
    least one, at most ``max_items``."""
    name = meta.inputs[0].name
    tensor = request.inputs[name]
    data = tensor.data
    if tensor.binary:
        data = [_utf8(name, i, e) for i, e in enumerate(data)]
    if not data:
        raise InvalidInput(f"input '{name}' is empty: nothing to infer", param=f"inputs.{name}")
    if len(data) > max_items:
        raise TooManyItems(f"input '{name}' has {len(data)} items; this model takes at most "
                           f"{max_items} per request", param=f"inputs.{name}")
    return data


def _utf8(name: str, i: int, element: str | bytes) -> str:
    if isinstance(element, str):
        return element
    try:
        return element.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"input '{name}' element {i} is not valid UTF-8",
                           param=f"inputs.{name}") from None


def rows(meta: ModelMetadata, output: np.ndarray) -> list[Tensor]:
    """The rows as the model's one output tensor."""
    spec = meta.outputs[0]
    return [Tensor(spec.name, spec.datatype, output.shape, output)]


def identity(texts: Sequence[str]) -> Sequence[str]:
    """The texts identify the answer (shared by V2 and OpenAI embeddings: one cache
    entry)."""
    return texts
