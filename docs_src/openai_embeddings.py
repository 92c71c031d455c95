"""The official openai SDK, unchanged, against Sokuji's /v1/embeddings."""

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("SOKUJI_URL", "http://127.0.0.1:8000") + "/v1",
                api_key=os.environ.get("SOKUJI_API_KEY", "none"))
result = client.embeddings.create(model="minilm", input=["first text", "second text"])
print(len(result.data), "embeddings of", len(result.data[0].embedding), "floats;",
      result.usage.prompt_tokens, "tokens")
