"""Triton's own gRPC client, unchanged, on Sokuji's gRPC port (8001 as Triton's)."""

import os

import numpy as np
import tritonclient.grpc as grpcclient

client = grpcclient.InferenceServerClient(os.environ.get("SOKUJI_GRPC", "127.0.0.1:8001"))
print("live:", client.is_server_live(), "ready:", client.is_model_ready("minilm"))
text = grpcclient.InferInput("text", [1], "BYTES")
text.set_data_from_numpy(np.array([b"over gRPC"], dtype=object))
result = client.infer("minilm", [text])
print("embeddings", result.as_numpy(result.get_response().outputs[0].name).shape)
