"""Chat with the built-in SmolLM2 through the openai SDK, streamed token by token."""

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("SOKUJI_URL", "http://127.0.0.1:8000") + "/v1",
                api_key=os.environ.get("SOKUJI_API_KEY", "none"))
stream = client.chat.completions.create(
    model="smollm2", stream=True, max_tokens=24, temperature=0,
    messages=[{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "What is the capital of France?"}])
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
