"""Kind ``pipeline``: a graph of steps over the other models, served as one model
(``[[pipelines]]`` entries, and the built-in ``rag``; ``sokuji/pipelines``)."""
