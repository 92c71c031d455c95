"""Audio models: voice activity detection (``vad.py``: silero-vad's torch-free ONNX model),
its segment rules (``vad_segments.py``, ported from silero) and a streaming front-end
(``vad_stream.py``). Imported only when a configured model uses runtime ``vad``; the file
decoding itself is ``sokuji/media/audio.py``."""
