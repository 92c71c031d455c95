"""Kind ``tensor``: any ONNX graph served as its named tensors (KServe V2), dynamically batched
along its batch dimension, requests of other shapes in batches of their own."""
