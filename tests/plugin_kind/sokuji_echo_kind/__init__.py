"""A kind of model that lives outside Sokuji: ``runtime = "echo"`` answers V2 infer with its
input times ``scale``, after ``delay_ms``. It registers itself through the ``sokuji.kinds``
entry-point group (``pyproject.toml``); ``docs/adding-a-kind.md`` walks through it."""
