"""Kind ``upstream``: an ``UpstreamModel`` (``routing/upstream.py``), which learns the remote
model's metadata when it is built. Its options: ``routing/config.py``'s ``UpstreamOptions``."""

from __future__ import annotations

from sokuji.config import ModelConfig
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.routing.config import UpstreamOptions


class UpstreamKind(Kind):
    options = UpstreamOptions

    def build(self, model: ModelConfig, options: UpstreamOptions, env: BuildEnv) -> Built:
        from sokuji.routing.upstream import UpstreamModel

        upstream = UpstreamModel(model, options,
                                 tenants={key.tenant for key in env.server.api_keys})
        upstream.load()
        return Built(upstream)


KIND = UpstreamKind()
