"""Plain JSON predict models for tests/integration/test_python_predict.py: an untyped class
(a dict of values in, any JSON out), and classes typed with a msgspec.Struct and with a
pydantic model, which count their calls (so a test can prove a refused input never reached
predict)."""

from __future__ import annotations

import msgspec
import pydantic


class Echo:
    """Untyped: each request's dict as is; the answer is any JSON (nested, ragged)."""

    def predict(self, inputs: list[dict]) -> list[dict]:
        return [{"got": item, "keys": sorted(item), "ragged": [[1], [2, 3]], "none": None}
                for item in inputs]


class Features(msgspec.Struct):
    sepal: list[float]
    petal: list[float]
    label: str = ""


class Score(msgspec.Struct):
    total: float
    count: int
    label: str


class StructScorer:
    """Typed with msgspec: the input is validated before queueing; ``calls`` counts the
    requests predict saw (answered by a request with ``calls`` asked)."""

    def setup(self, options: dict) -> None:
        self.calls = 0

    def predict(self, inputs: list[Features]) -> list[Score]:
        self.calls += len(inputs)
        return [Score(total=sum(f.sepal) + sum(f.petal), count=self.calls,
                      label=f.label or "none") for f in inputs]


class Query(pydantic.BaseModel):
    text: str
    repeat: int = 1


class Reply(pydantic.BaseModel):
    text: str
    count: int


class PydanticEcho:
    """Typed with pydantic, likewise counting its calls."""

    def setup(self, options: dict) -> None:
        self.calls = 0

    def predict(self, inputs: list[Query]) -> list[Reply]:
        self.calls += len(inputs)
        return [Reply(text=q.text * q.repeat, count=self.calls) for q in inputs]


class Counted:
    """Deterministic (the response cache may keep its answers): each answer says how many
    requests predict has seen, so a cached answer shows as an unchanged count."""

    deterministic = True

    def setup(self, options: dict) -> None:
        self.calls = 0

    def predict(self, inputs: list[dict]) -> list[dict]:
        self.calls += len(inputs)
        return [{"echo": item, "calls": self.calls} for item in inputs]
