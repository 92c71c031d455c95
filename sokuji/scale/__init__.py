"""Scale-out: Sokuji on Ray Serve (``sokuji serve --ray``; extra ``ray``).

- ``ray_env.py``: the environment a cluster needs (Ray's high-throughput mode, HAProxy's
  files and ports), the config's trip to a replica, cluster start / attach.
- ``ray_app.py``: the ingress deployment, one whole Sokuji per replica; the autoscaling
  policy on Sokuji's queue depth; ``app(args)`` for ``serve run``.
- ``ray_llm.py``: generators in deployments of their own behind a consistent-hash router
  (prefix-cache affinity), reached from the replicas through handles.
- ``launcher.py``: ``sokuji serve --ray``.

Nothing here is imported by ``sokuji serve`` without ``--ray``.
"""
