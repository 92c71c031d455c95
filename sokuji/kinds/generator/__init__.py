"""Kind ``llama``: a GGUF served by Sokuji's continuous-batching engine over llama.cpp
(``sokuji/llm``): chat and completions, streamed."""
