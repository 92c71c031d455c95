"""Kind ``onnx``: a text encoder on ONNX Runtime (texts in, one vector per text out), batched
by length, with the variants ``sokuji optimize`` made served as versions."""
