"""What a Python model's ``predict`` returned, checked before anyone reads it: one result
per request, in order, each of a type the protocols can carry. What fails is a
``BadModelOutput`` (502) naming the model and what was wrong, for every request of the
batch (which result is wrong says nothing about which request was).

A result is a dict of named values (a value: a numpy array or scalar, or a JSON value:
str, bytes, int, float, bool, None, list, dict), an instance of the class's declared output
type, or, for a function entry, any such value itself; or an exception instance, which
fails that one request (``runner.py``: a ``SokujiError`` as itself, any other as the model's
own failure). Nested containers are checked where
they are encoded (an unencodable value deep in a list is a ``BadModelOutput`` there too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sokuji.errors import BadModelOutput

VALUE_TYPES = (np.ndarray, np.generic, str, bytes, int, float, bool, list, tuple, dict,
               type(None))


def check(results: Any, size: int, model: str, output_type: Any = None,
          function: bool = False) -> list[Any]:
    """``results`` for a batch of ``size`` requests, as a list; ``BadModelOutput`` when it
    is not one result of an allowed type per request."""
    if not isinstance(results, (list, tuple)):
        raise BadModelOutput(f"model '{model}': predict returned a {type(results).__name__}; "
                             f"it must return a list with one result per request ({size})")
    if len(results) != size:
        raise BadModelOutput(f"model '{model}': predict returned {len(results)} results for "
                             f"a batch of {size} requests")
    for i, result in enumerate(results):
        check_one(result, i, model, output_type, function)
    return list(results)


def check_one(result: Any, i: int, model: str, output_type: Any = None,
              function: bool = False) -> None:
    """One result (the ``i``-th of its batch, or of a stream's step). An exception is that
    request's failure (Triton's per-response error): it fails that request alone."""
    if isinstance(result, BaseException):
        return
    if function:
        _value(result, f"result {i}", model)
        return
    if output_type is not None:
        if not isinstance(result, output_type):
            raise BadModelOutput(f"model '{model}': result {i} is a "
                                 f"{type(result).__name__}, not the declared "
                                 f"{output_type.__name__}")
        return
    if not isinstance(result, Mapping):
        raise BadModelOutput(f"model '{model}': result {i} is a {type(result).__name__}; "
                             "each result must be a dict of named outputs")
    for name, value in result.items():
        if not isinstance(name, str):
            raise BadModelOutput(f"model '{model}': result {i} has an output named "
                                 f"{type(name).__name__} {name!r}; names must be strings")
        _value(value, f"result {i}, output {name!r}", model)


def _value(value: Any, where: str, model: str) -> None:
    if not isinstance(value, VALUE_TYPES):
        raise BadModelOutput(f"model '{model}': {where} is a {type(value).__name__}, "
                             "neither an array nor a JSON value")
    if isinstance(value, np.ndarray) and value.dtype == object:
        for item in value.reshape(-1)[:1].tolist():
            if not isinstance(item, (str, bytes)):
                raise BadModelOutput(f"model '{model}': {where} is an object array of "
                                     f"{type(item).__name__}; only strings (BYTES) may be")
