"""Routing (imported only when a configured model is an upstream or a router): models that
are other servers (``upstream.py``), routers that pick a target per request by rules, a
cascade or a canary (``router.py``), circuit breakers, canary statistics, the semantic
cache's store."""
