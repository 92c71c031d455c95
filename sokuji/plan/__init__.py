"""``sokuji plan``: capacity and cost from ``sokuji bench`` results.

inputs.py     bench results (schema sokuji.bench/1) and the server's /config, /stats
simulate.py   one encoder replica simulated: work-conserving batches on one core
fit.py        its service time fitted to the runs (a lone request, runs at capacity)
planner.py    replicas for a rate within an SLO, cores, cost, curves, variants
generator.py  generators: the highest rate within TTFT / ITL SLOs, read off streaming runs
memory.py     weights, KV cache (from the GGUF's metadata), buffers
report.py     table, JSON (sokuji.plan/1), HTML with plots
cli.py        arguments, exit codes
"""
