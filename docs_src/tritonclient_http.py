"""Triton's own HTTP client, unchanged: binary tensors both ways."""

import os

import numpy as np
import tritonclient.http as httpclient

url = os.environ.get("SOKUJI_URL", "http://127.0.0.1:8000").removeprefix("http://")
client = httpclient.InferenceServerClient(url)
text = httpclient.InferInput("text", [2], "BYTES")
text.set_data_from_numpy(np.array([b"hello", b"world"], dtype=object), binary_data=True)
result = client.infer("minilm", [text])
embeddings = result.as_numpy(result.get_response()["outputs"][0]["name"])
print("embeddings", embeddings.shape, embeddings.dtype)
print("server-side queue + compute:", client.get_inference_statistics("minilm")
      ["model_stats"][0]["inference_stats"]["success"])
