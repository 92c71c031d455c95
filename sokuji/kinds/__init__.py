"""Kinds of model, one package each: what a kind declares is in ``kinds/kind.py``; which kinds
there are, by name, in ``repository/registry.py``. Nothing is imported here: a kind's package
is imported only when a configured model uses it."""
