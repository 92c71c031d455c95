"""Sokuji: a latency-first AI inference server. Importing it loads no runtime."""

__version__ = "0.1.0"
