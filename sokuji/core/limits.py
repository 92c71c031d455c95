"""A served model's cost bound: the most work one request may cause, stated before any of it.

Every kind states its ``limits``: one ``Limit`` per quantity whose size decides what a request
costs (bytes held, pixels after every resize and pad, crops, audio samples after resampling,
tokens, steps, seconds). A request is measured against them *before* the work they bound is
done; one past a limit is refused with ``LimitExceeded`` (413), whose message names the limit,
the key that sets it and what the request would have needed. The limits are shown in the
model's configuration (``GET /v2/models/{m}/config``, ``sokuji.limits``) so a client can size
its requests, and the hostile-input suite (``tests/hostile``) sends each model of every kind
requests just past each of them.

Pure: no HTTP, no runtime imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sokuji.errors import PayloadTooLarge


@dataclass(frozen=True)
class Limit:
    """One bound on one request's work."""

    key: str
    """The setting that sets it, as the config spells it (``max_request_bytes``,
    ``options.max_side``): what an operator changes to move it."""
    value: int | float
    unit: str
    """``bytes``, ``pixels``, ``crops``, ``samples``, ``tokens``, ``steps``, ``seconds``..."""
    what: str
    """What is counted, in words (``pixels of one image after every resize and pad``)."""

    def check(self, need: int | float, subject: str = "the request") -> None:
        """Refuse ``need`` past the limit: ``LimitExceeded`` naming it."""
        if not need <= self.value:  # (NaN is past every limit)
            raise LimitExceeded(self, need, subject)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "unit": self.unit, "what": self.what}


class LimitExceeded(PayloadTooLarge):
    """A request past one of its model's limits: 413, before the work is done."""

    code = "limit_exceeded"

    def __init__(self, limit: Limit, need: int | float, subject: str = "the request") -> None:
        super().__init__(f"{subject} needs {need:g} {limit.unit} ({limit.what}); the limit "
                         f"is {limit.key} = {limit.value:g}", param=limit.key)
        self.limit = limit
        self.need = need


def to_json(limits: tuple[Limit, ...]) -> list[dict[str, Any]]:
    return [limit.to_json() for limit in limits]
