"""Kind ``upstream``: a model that is another server (KServe V2: Sokuji, Triton; OpenAI:
Sokuji, llama-server, vLLM), called over a pooled connection."""
