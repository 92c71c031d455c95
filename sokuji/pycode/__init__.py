"""The user's own Python code as a model (kind ``python``, ``kinds/python/``): the class
loaded from its entry (``entry.py``), called in a thread of the server (``inthread.py``) or
in worker processes (``pool.py``), its results checked (``results.py``), the stages it
reports timed (``stage.py``). Imported only when a configured model is a Python model."""
