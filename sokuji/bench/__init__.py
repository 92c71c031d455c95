"""``sokuji bench``: a load generator for any inference server. It imports nothing from
``sokuji.server``: it is a client, and works against Triton, vLLM or anything with a URL."""
