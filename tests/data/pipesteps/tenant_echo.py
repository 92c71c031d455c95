"""A pipeline step that answers with the caller's tenant (``tests/hostile``): a response cache
shared between tenants would hand one tenant another's answer, visibly."""

from __future__ import annotations

from typing import Any


def whoami(question: str, ctx: Any) -> str:
    return f"{question} (answered for {ctx.tenant})"
