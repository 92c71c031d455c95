"""Kind ``ocr``: a ``OcrEngine`` (``sokuji/vision/ocr.py``) under a ``MediaModel``
(``media/model.py``: admission in files, the deadline, decoding in the media lane).
Its options are ``OcrOptions`` (``vision/ocr_options.py``)."""

from __future__ import annotations

import msgspec

from sokuji.config import ModelConfig
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.vision.ocr_options import OcrOptions


class OcrKind(Kind):
    options = OcrOptions

    def parse(self, model: ModelConfig, at: str) -> OcrOptions:
        """The schema's options, with the model's own where the table leaves them out: its
        ``intra_op_threads`` (or 1) for the sessions' threads, its aging rule for the
        engine's queues."""
        options: OcrOptions = super().parse(model, at)
        threads = model.intra_op_threads or 1
        fills = {"det_threads": threads, "rec_threads": threads,
                 "priority_aging_ms": model.priority_aging_ms}
        return msgspec.structs.replace(
            options, **{k: v for k, v in fills.items() if k not in model.options})

    def build(self, model: ModelConfig, options: OcrOptions, env: BuildEnv) -> Built:
        from sokuji.media.model import MediaModel
        from sokuji.vision.ocr import OcrEngine

        return Built(MediaModel.over(model, OcrEngine(model.name, options)))


KIND = OcrKind()
