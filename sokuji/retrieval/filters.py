"""Metadata filters: ``{key: value | [values]}``, every key must match (AND), a list matches
any of its values (OR). They become a boolean mask over the passages that both scorers take
before scoring (BM25's weight mask, the ANN index's id selector)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from sokuji.errors import InvalidInput

MAX_VALUES = 100


def validate(filters: object, keys: Sequence[str]) -> dict[str, list[str]]:
    """The filters as ``{key: [values]}``; ``InvalidInput`` (naming the field) for anything
    else: not a mapping, an unknown key, a value that is not a string or a non-empty list of
    strings."""
    if filters is None:
        return {}
    if not isinstance(filters, Mapping):
        raise InvalidInput("filters must be an object of metadata key -> value or list of "
                           f"values, got {type(filters).__name__}", param="filters")
    out: dict[str, list[str]] = {}
    for key, value in filters.items():
        if key not in keys:
            raise InvalidInput(f"filters.{key}: unknown metadata key; this index has "
                               f"{sorted(keys)}", param=f"filters.{key}")
        values = [value] if isinstance(value, str) else value
        if (not isinstance(values, list) or not values or len(values) > MAX_VALUES
                or not all(isinstance(v, str) for v in values)):
            raise InvalidInput(f"filters.{key} must be a string or a list of 1 to "
                               f"{MAX_VALUES} strings", param=f"filters.{key}")
        out[key] = values
    return out


def mask(columns: Mapping[str, np.ndarray], filters: Mapping[str, list[str]]) -> np.ndarray | None:
    """Boolean mask of the passages every filter admits; ``None`` when there are no filters
    (all admitted). ``columns``: one object array of strings per metadata key."""
    if not filters:
        return None
    admitted: np.ndarray | None = None
    for key, values in filters.items():
        m = np.isin(columns[key], np.asarray(values, dtype=object))
        admitted = m if admitted is None else admitted & m
    return admitted
