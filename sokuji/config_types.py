"""The config schema's building blocks: constrained scalar types, the TOML table base, and the
reason each constraint gives when it fails (``config_errors.py`` turns it into a
``ConfigError``). The server's schema is built from them, and so is each kind's options
schema."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct


def _why(reason: str, **constraints: Any) -> Meta:
    """A constraint whose failure (or a wrong type) is reported with ``reason``."""
    return Meta(**constraints, extra={"reason": reason})


AtLeast1 = Annotated[int, Meta(ge=1)]
ZeroOrMore = Annotated[int, Meta(ge=0)]
ZeroOrMoreS = Annotated[float, Meta(ge=0)]  # milliseconds or seconds
MoreThanZero = Annotated[float, Meta(gt=0)]
Fraction = Annotated[float, _why("must be a number from 0 to 1", ge=0, le=1)]
NonEmpty = Annotated[str, _why("must be a non-empty string", min_length=1)]
Secret = Annotated[str, _why("must be a string, empty or of at least 16 characters",
                             pattern=r"\A(?s:.{16,})?\Z")]
Hosts = Annotated[tuple[str, ...], _why("must be a list of hosts or CIDR networks")]
Priority = Literal["interactive", "batch"]
Runtime = Annotated[str, _why("must be a kind's name (onnx, llama, ...)",
                              pattern=r"\A[A-Za-z0-9_.-]{1,64}\Z")]
"""A kind's name; which names exist is the registry's (``repository/registry.py``)."""


class _Table(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A TOML table: unknown keys are errors; built in code without checks (see ``validate``)."""
