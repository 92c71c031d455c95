"""Stores: what Sokuji keeps outside the process's own logic, on SQLite or Redis. Each fulfils a
contract of ``sokuji/core`` (the job store: ``core/job.py``; a response-cache backend:
``core/cache.py``) and is imported only when the config asks for it.

    jobs_sqlite.py   durable jobs on SQLite (WAL)
    jobs_redis.py    the same on Redis, for replicas that share their jobs
    cache_memory.py  the response cache in process: LRU bounded in bytes, TTL
    cache_redis.py   the response cache on Redis, shared between replicas
"""
