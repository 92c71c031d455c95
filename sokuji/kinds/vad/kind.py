"""Kind ``vad``: a ``VadEngine`` (``sokuji/audio/vad.py``) under a ``MediaModel``
(``media/model.py``: admission in files, the deadline, decoding in the media lane).
Its options are ``VadOptions`` (``audio/vad_options.py``)."""

from __future__ import annotations

import msgspec

from sokuji.audio.vad_options import VadOptions
from sokuji.config import ModelConfig
from sokuji.kinds.kind import BuildEnv, Built, Kind


class VadKind(Kind):
    options = VadOptions

    def parse(self, model: ModelConfig, at: str) -> VadOptions:
        """The schema's options, with the model's own where they leave it open: its
        ``intra_op_threads`` for ``threads = 0``, its aging rule for the engine's queue
        unless the table sets one."""
        options: VadOptions = super().parse(model, at)
        fills: dict[str, float] = {}
        if options.threads == 0:
            fills["threads"] = model.intra_op_threads
        if "priority_aging_ms" not in model.options:
            fills["priority_aging_ms"] = model.priority_aging_ms
        return msgspec.structs.replace(options, **fills)

    def build(self, model: ModelConfig, options: VadOptions, env: BuildEnv) -> Built:
        from sokuji.audio.vad import VadEngine
        from sokuji.media.model import MediaModel

        return Built(MediaModel.over(model, VadEngine(model.name, options)))


KIND = VadKind()
