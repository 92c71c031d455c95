"""Generative models: llama.cpp under a continuous-batching engine."""
