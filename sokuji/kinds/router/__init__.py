"""Kind ``router``: one of other models per request (rules, a canary, a cascade), with a
circuit breaker per target, fallbacks and shadow traffic (``sokuji/routing``)."""
