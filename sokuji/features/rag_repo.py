"""The built-in ``rag`` pipeline's feature repository, defined in code.

Entity ``user`` (join key ``user_id``, a string) and one feature view ``user_profile`` with what
a RAG answer can adapt to: the reader's ``expertise``, ``preferred_length``, the
``python_version`` they use, their ``plan`` and how many ``questions_asked`` so far. The users
are generated from a seed (``generate_users``): the same ``(num_users, seed)`` always gives the
same rows, so tests and benchmarks know every value the store must return.

Nothing here imports Feast at module level; ``feast_objects`` does, when the store is set up.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

PROJECT = "sokuji_rag"
ENTITY = "user"
JOIN_KEY = "user_id"
VIEW = "user_profile"
# Bump when the definitions below change: it is part of the setup fingerprint, so a changed
# repository is applied and materialized again at the next start.
DEFINITION_VERSION = 1

EXPERTISE = ("beginner", "intermediate", "expert")
LENGTHS = ("short", "long")
PYTHON_VERSIONS = ("3.9", "3.10", "3.11", "3.12", "3.13")
PLANS = ("free", "pro")
# name -> Feast type name (feast.types); the order is the view's schema order.
FEATURES: dict[str, str] = {
    "expertise": "String",
    "preferred_length": "String",
    "python_version": "String",
    "plan": "String",
    "questions_asked": "Int64",
}
# All rows share one event time, so materialization needs one fixed window around it.
EVENT_TIME = datetime(2026, 1, 1, tzinfo=UTC)
MATERIALIZE_WINDOW = (EVENT_TIME - timedelta(days=1), EVENT_TIME + timedelta(days=1))


def user_id(index: int) -> str:
    return f"user-{index:04d}"


def generate_users(num_users: int, seed: int) -> list[dict[str, Any]]:
    """``num_users`` rows ``{user_id, <FEATURES>}``, a pure function of ``(num_users, seed)``.
    Expertise is skewed towards beginners and pro users ask more, as a real population would."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_users):
        plan = rng.choices(PLANS, weights=(3, 1))[0]
        rows.append({
            JOIN_KEY: user_id(i),
            "expertise": rng.choices(EXPERTISE, weights=(5, 3, 2))[0],
            "preferred_length": rng.choice(LENGTHS),
            "python_version": rng.choice(PYTHON_VERSIONS),
            "plan": plan,
            "questions_asked": rng.randrange(0, 400 if plan == "pro" else 40),
        })
    return rows


def write_source(path: Path, rows: list[dict[str, Any]]) -> None:
    """The offline source Feast materializes from: one parquet file (pandas + pyarrow, which
    Feast brings), written to a temporary name and renamed so a reader never sees half."""
    import pandas as pd

    frame = pd.DataFrame(rows, columns=[JOIN_KEY, *FEATURES])
    frame["questions_asked"] = frame["questions_asked"].astype("int64")
    frame["event_timestamp"] = pd.Timestamp(EVENT_TIME)
    tmp = path.with_suffix(".tmp")
    frame.to_parquet(tmp, index=False)
    tmp.replace(path)


def feast_objects(source_path: Path) -> list[Any]:
    """The Feast definitions to ``apply``: the entity and the feature view over the parquet
    source. ``ttl=0`` means the values never expire (they are a profile, not an event)."""
    from feast import Entity, FeatureView, Field, FileSource, ValueType, types

    user = Entity(name=ENTITY, join_keys=[JOIN_KEY], value_type=ValueType.STRING,
                  description="a reader of the rag pipeline's answers")
    source = FileSource(name=f"{VIEW}_source", path=str(source_path),
                        timestamp_field="event_timestamp")
    view = FeatureView(
        name=VIEW, entities=[user], ttl=timedelta(0), online=True, source=source,
        schema=[Field(name=JOIN_KEY, dtype=types.String)]
        + [Field(name=name, dtype=getattr(types, kind)) for name, kind in FEATURES.items()],
    )
    return [user, view]
