"""A pipeline step's function loaded by file path (``tests/data/pipesteps/steps_file.py:
shout``), importing a sibling module as running the file would."""

from __future__ import annotations

from steps_sibling import SUFFIX  # type: ignore[import-not-found]


def shout(question: str) -> str:
    return question.upper() + SUFFIX
