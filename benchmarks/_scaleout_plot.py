"""The PNG of ``ray_scaleout.py``: what was measured side by side, the 1-100 replica model,
and the model against 2 local replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    s = report["summary"]
    names = ["single", "ray1", "ray2"]
    x = range(len(names))
    a = ax[0][0]
    for k, (conns, off) in enumerate((("c8", -0.2), ("c48", 0.2))):
        a.bar([i + off for i in x], [s[conns]["rps"][n] for n in names], width=0.4,
              label=f"closed loop, {conns[1:]} connections", color=f"C{k}")
    a.set_xticks(list(x), ["single process", "Ray, 1 replica", "Ray, 2 replicas"])
    a.set_ylabel("requests / s")
    p50 = s["idle_p50_ms"]
    a.set_title(f"MiniLM, measured (2-core machine, client included)\nidle p50: single "
                f"{p50['single']:.2f} ms, Ray via HAProxy {p50['ray1']:.2f} ms, "
                f"direct {p50['ray1_direct']:.2f} ms", fontsize=9)
    a.legend(fontsize=8)

    m = report["model"]
    rows = m["rows"]
    n = [r["replicas"] for r in rows]
    a = ax[0][1]
    a.plot(n, [r["capacity_rps"] for r in rows], "o-", label="capacity (all batches full)")
    a.plot(n, [r["throughput_rps"] for r in rows], "s--",
           label=f"throughput at {m['utilisation']:.0%} of capacity")
    a.axhline(m["balancer_capacity_rps"], color="grey", ls=":",
              label="one HAProxy (4 threads) at its measured CPU / request")
    chk = report["checks"]["minilm"]
    a.plot([2], [chk["measured"]["throughput_rps"]], "r*", ms=12,
           label="measured, 2 local replicas sharing 2 cores with the client")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("replicas")
    a.set_ylabel("requests / s")
    a.set_title("model: throughput (one replica = single-process fit + Ray's cost)",
                fontsize=9)
    a.legend(fontsize=7)

    a = ax[1][0]
    a.plot(n, [r["p99_ms"] for r in rows], "o-", label="p99, leastconn (simulated)")
    a.plot(n, [r["p99_ms_random_split"] for r in rows], "--",
           label="p99, even random split (one replica's)")
    a.plot(n, [r["p50_ms"] for r in rows], ".-", label="p50, leastconn")
    syn = report["checks"]["synthetic"]
    a.set_xscale("log")
    a.set_xlabel("replicas")
    a.set_ylabel("ms")
    a.set_title(f"model: latency at {m['utilisation']:.0%} of capacity\nchecks (2 replicas):"
                f"\nsynthetic p99 measured {syn['measured']['p99_ms']:.0f} vs leastconn "
                f"{syn['predicted_leastconn']['p99_ms']:.0f} / random "
                f"{syn['predicted_random']['p99_ms']:.0f} ms;\nMiniLM (shared cores) p99 measured "
                f"{chk['measured']['p99_ms']:.1f} vs {chk['predicted_leastconn']['p99_ms']:.1f}"
                " ms", fontsize=8)
    a.legend(fontsize=7)

    a = ax[1][1]
    curve = m["curve"]
    cn = [c["replicas"] for c in curve]
    a.plot(cn, [c.get("per_1m_requests") for c in curve], "-", color="C2",
           label=f"USD per 1M requests (at {m['price_per_core_hour']} a core-hour)")
    a.set_xlabel("replicas")
    a.set_ylabel("USD per 1M requests")
    b = a.twinx()
    b.plot(cn, [c["memory_mb"] / 1024 for c in curve], "-", color="C3", label="memory (GB)")
    b.plot(cn, [c["cores"] for c in curve], "--", color="C4", label="cores")
    b.set_ylabel("GB / cores")
    a.set_title(f"model: cost at {m['utilisation']:.0%} of capacity", fontsize=9)
    lines = a.get_legend_handles_labels()
    more = b.get_legend_handles_labels()
    a.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
