"""Kind ``upstream``: an ``UpstreamModel`` (``routing/upstream.py``), which learns the remote
model's metadata when it is built."""

from __future__ import annotations

from typing import Any

from sokuji.config import ModelConfig
from sokuji.kinds.kind import BuildEnv, Built, Kind


class UpstreamKind(Kind):
    def parse(self, model: ModelConfig, at: str) -> Any:
        from sokuji.routing.config import parse_upstream

        return parse_upstream(model.options, f"{at}.options")

    def build(self, model: ModelConfig, options: Any, env: BuildEnv) -> Built:
        from sokuji.routing.upstream import UpstreamModel

        upstream = UpstreamModel(model, options)
        upstream.load()
        return Built(upstream)


KIND = UpstreamKind()
