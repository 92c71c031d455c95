"""The registry of kinds, the repository of served models, the built-in defaults."""
