"""Image and audio models: encoded files in (PNG, JPEG, WebP; WAV, FLAC), structured outputs.

``engine.py`` is the contract between the serving layer (``model.py``: admission, deadlines,
the media lane, timing) and an engine (``sokuji/vision/ocr.py``, ``sokuji/audio/vad.py``)
that decodes a file and runs its ONNX sessions on threads of its own. Imported only when a
configured model uses runtime ``ocr`` or ``vad``.
"""
