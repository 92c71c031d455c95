"""Hybrid retrieval: BM25 keyword candidates (``bm25s``) and dense vectors in an ANN index
(``faiss``), fused by reciprocal rank fusion, metadata filters applied before scoring,
optional exact-cosine re-ranking; one on-disk index directory.

Kept light: importing ``sokuji.retrieval`` imports neither bm25s nor the ANN library. Use
``sokuji.retrieval.index`` (``HybridIndex``, ``Hit``, ``build_index``) and
``sokuji.retrieval.corpus`` (``Passage``, ``pydoc_passages``).
"""
