"""Kind ``ocr``: a ``OcrEngine`` (``sokuji/vision/ocr.py``) under a ``MediaModel``
(``media/model.py``: admission in files, the deadline, decoding in the preparation pool)."""

from __future__ import annotations

from typing import Any

from sokuji.config import ModelConfig
from sokuji.kinds.kind import BuildEnv, Built, Kind


class OcrKind(Kind):
    def parse(self, model: ModelConfig, at: str) -> Any:
        return model.options  # checked by the engine when it is built

    def build(self, model: ModelConfig, options: Any, env: BuildEnv) -> Built:
        from sokuji.media.model import MediaModel
        from sokuji.vision.ocr import OcrEngine

        # The model's aging rule reaches the engine's queues as an option (an explicit
        # option wins).
        options = {"priority_aging_ms": model.priority_aging_ms, **options}
        engine = OcrEngine(model.name, options, model.intra_op_threads)
        engine.load()
        if model.warmup:
            engine.warmup()
        return Built(MediaModel(model, engine))


KIND = OcrKind()
