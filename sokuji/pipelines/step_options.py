"""The options of a pipeline's steps, by the step's kind, as schemas: checked when the config
loads (``graph.check_pipeline``: errors name ``pipelines[i].steps[j].options.<key>``) and
given to the step that is built from them (``steps.build_step``). A ``python`` step's options
are its function's own (and ``thread``): no schema but the function's signature.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from sokuji import config_errors
from sokuji.config_types import AtLeast1, NonEmpty, ZeroOrMore, _Table, _why
from sokuji.pipelines.config import StepConfig


class RetrieveOptions(_Table, frozen=True):
    """Hybrid retrieval (``sokuji/retrieval``): which index, which encoder embeds the query,
    and the search's parameters (``retrieval/query.py`` bounds them the same way)."""

    index: NonEmpty = "pydoc"
    """``pydoc`` (the built-in index) or the path of an index directory."""
    encoder: NonEmpty | None = None
    """The served encoder that embeds queries (every mode but bm25 needs one)."""
    k: Annotated[int, _why("must be an integer from 1 to 100", ge=1, le=100)] = 5
    mode: Literal["bm25", "dense", "hybrid"] = "hybrid"
    candidates: Annotated[int, _why("must be an integer from 1 to 1000", ge=1, le=1000)] = 50
    rerank: bool = False
    filters: Mapping[str, Any] | None = None
    """Filters every search of this step applies (a request's own replace them)."""


class FeaturesOptions(_Table, frozen=True):
    """An online feature store lookup (``sokuji/features``)."""

    features: Annotated[tuple[str, ...],
                        _why("must be a non-empty list of feature names", min_length=1)]
    store: NonEmpty = "users"
    """``users`` (the built-in store) or the path of a Feast repository."""
    entity: NonEmpty = "user"
    scope_by_tenant: bool = True
    """With API keys, ids are looked up as ``<tenant>:<id>`` (``features/tenant_ids.py``)."""


class GenerateOptions(_Table, frozen=True):
    """A generator step's sampling (the request's own when the step streams the answer)."""

    max_tokens: AtLeast1 | None = None
    temperature: Annotated[float, _why("must be from 0 to 2", ge=0, le=2)] = 0.0
    top_p: Annotated[float, _why("must be above 0 and at most 1", gt=0, le=1)] = 1.0
    seed: int | None = None
    stop: str | tuple[str, ...] = ()
    min_tokens: ZeroOrMore = 0


SCHEMAS: dict[str, type[Any]] = {"retrieve": RetrieveOptions, "features": FeaturesOptions,
                                 "model": GenerateOptions}
"""Step kind -> its options schema (kinds not here take any options)."""


def step_options(step: StepConfig, at: str) -> Any:
    """``step``'s options as its kind's schema (``at``: the step's key,
    ``pipelines[0].steps[2]``), or as given for a kind without one."""
    schema = SCHEMAS.get(step.kind)
    if schema is None:
        return step.options
    return config_errors.convert(step.options, schema, f"{at}.options")
