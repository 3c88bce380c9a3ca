"""Routers on the Mooncake conversation trace at 4, 8 and 16 replicas, and the single-pool bound.

For each cluster size N, every router of ``[cluster]`` runs the scenario
``scenarios/mooncake_conversation_cluster.toml`` (the first ``--window-s`` seconds of the trace);
then the single-pool bound: one engine holding the cluster's whole KV cache
(``num_gpu_blocks`` x N) and its compute (``tensor_parallel_size``, ``max_num_seqs`` and
``max_num_batched_tokens`` x N; no communication cost), the cache a global KV pool (Mooncake's
Store) would share. Writes ``mooncake_cluster.csv`` and ``mooncake_cluster.png`` (hit rate and
TTFT p50 / p99 per router and size) to ``--out`` and prints a table with the ratio of the pool's
hit rate to each router's, beside Mooncake's reported up-to-2.36x.

    python studies/mooncake_cluster.py --out plots/   # the trace must be in the trace cache
"""

from __future__ import annotations

import argparse
import csv
import time
import tomllib
from pathlib import Path

from kvsim import engine, metrics, overrides
from kvsim.config import ROUTERS, parse_scenario
from kvsim.workload import build_requests

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "mooncake_conversation_cluster.toml"
COLUMNS = ("replicas", "router", "num_requests", "num_finished", "prefix_cache_hit_rate",
           "ttft_p50_ms", "ttft_p99_ms", "pool_hit_rate_ratio", "cpu_s")


def simulate(raw: dict) -> dict:
    sc = parse_scenario(raw, SCENARIO)
    start = time.process_time()
    rec = engine.run(sc, build_requests(sc))
    s = metrics.summarize(sc, rec)
    return {"num_requests": s["num_requests"], "num_finished": s["num_finished"],
            "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
            "ttft_p50_ms": 1e3 * s["ttft_s"]["p50"], "ttft_p99_ms": 1e3 * s["ttft_s"]["p99"],
            "cpu_s": time.process_time() - start}


def pool_bound(raw: dict, n: int) -> dict:
    """One engine with the cluster's blocks and compute (see the module doc)."""
    one = parse_scenario(overrides.apply(raw, "cluster", "replicas", 1), SCENARIO)
    e = one.engine
    v = {k: val for k, val in raw.items() if k != "cluster"}
    for key, value in (("num_gpu_blocks", e.num_gpu_blocks * n),
                       ("tensor_parallel_size", e.tensor_parallel_size * n),
                       ("max_num_seqs", e.max_num_seqs * n),
                       ("max_num_batched_tokens", e.max_num_batched_tokens * n)):
        v = overrides.apply(v, "engine", key, value)
    return simulate(v)


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["replicas"] for r in rows})
    names = [*ROUTERS, "single pool"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    width = 0.8 / len(names)
    for ax, (key, title, scale) in zip(axes, (
            ("prefix_cache_hit_rate", "Prefix-cache hit rate (%)", 100),
            ("ttft_p50_ms", "TTFT p50 (ms)", 1), ("ttft_p99_ms", "TTFT p99 (ms)", 1))):
        for j, name in enumerate(names):
            vals = [next(r[key] for r in rows if r["replicas"] == n and r["router"] == name) * scale
                    for n in sizes]
            ax.bar([i + j * width for i in range(len(sizes))], vals, width, label=name,
                   hatch="//" if name == "single pool" else None)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(sizes))],
                      [f"{n} replicas" for n in sizes])
        ax.set_title(title)
        if key != "prefix_cache_hit_rate":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("Mooncake conversation trace, first ten minutes: routers vs one pool of the "
                 "cluster's KV cache (kvsim, roofline cost: uncalibrated)")
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="plots", help="folder for the CSV and the figure")
    ap.add_argument("--replicas", default="4,8,16", help="cluster sizes, comma-separated")
    ap.add_argument("--window-s", type=float, default=600.0, help="trace seconds replayed")
    args = ap.parse_args()
    raw = tomllib.loads(SCENARIO.read_text())
    raw = overrides.apply(raw, "workload", "window_end_s", args.window_s)
    rows = []
    for n in (int(x) for x in args.replicas.split(",")):
        sized = overrides.apply(raw, "cluster", "replicas", n)
        pool = {"replicas": n, "router": "single pool", **pool_bound(sized, n)}
        for router in ROUTERS:
            r = {"replicas": n, "router": router,
                 **simulate(overrides.apply(sized, "cluster", "router", router))}
            r["pool_hit_rate_ratio"] = pool["prefix_cache_hit_rate"] / r["prefix_cache_hit_rate"]
            rows.append(r)
            print(f"{n:>3} {router:17} hit {100 * r['prefix_cache_hit_rate']:5.1f} %  TTFT p50 "
                  f"{r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:9.1f} ms  pool/router hit "
                  f"{r['pool_hit_rate_ratio']:.2f}x  ({r['cpu_s']:.0f} s CPU)", flush=True)
        pool["pool_hit_rate_ratio"] = 1.0
        rows.append(pool)
        print(f"{n:>3} {'single pool':17} hit {100 * pool['prefix_cache_hit_rate']:5.1f} %  TTFT p50 "
              f"{pool['ttft_p50_ms']:8.1f} ms  p99 {pool['ttft_p99_ms']:9.1f} ms  "
              f"(Mooncake reports a global pool's hit rate up to 2.36x local caches')", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "mooncake_cluster.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()}
                    for r in rows)
    plot(rows, out / "mooncake_cluster.png")
    print(f"wrote {out / 'mooncake_cluster.csv'} and {out / 'mooncake_cluster.png'}")


if __name__ == "__main__":
    main()
