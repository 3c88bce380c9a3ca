"""CPU KV offloading on the Mooncake conversation hour: what 0, 64, 256 and 1,024 GiB buy.

Runs ``scenarios/mooncake_conversation_offload.toml`` (Llama-3.1-8B on one H100, vLLM 0.33.0,
the hour at ``speedup`` 0.4) once per ``engine.kv_offloading_size`` and writes
``cpu_offload.csv`` and ``cpu_offload.png`` to ``--out``: tokens served by the GPU prefix cache
and by the CPU tier (vLLM's ``prompt_tokens_cached_by_source``), TTFT, and the tier's load and
store traffic.

    python studies/cpu_offload.py --out plots/    # the trace must be in the trace cache
    python studies/cpu_offload.py --out plots/ --eagle3   # the same with EAGLE-3, 3 drafts

With ``--eagle3`` the files are ``cpu_offload_eagle3.*``: speculative decoding whose prefix
cache 0.33 keeps whole with lookahead block hashes, which any KV connector turns off.
"""

from __future__ import annotations

import argparse
import csv
import time
import tomllib
from pathlib import Path

from kvsim import engine, metrics, overrides
from kvsim.config import parse_scenario
from kvsim.model import GiB
from kvsim.workload import build_requests

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "mooncake_conversation_offload.toml"
SIZES_GIB = (0, 64, 256, 1024)
COLUMNS = ("kv_offloading_size", "num_cpu_chunks", "prompt_tokens", "device_hit_tokens",
           "host_hit_tokens", "ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "e2e_mean_s",
           "load_gib", "store_gib", "num_preemptions", "cpu_s")


def simulate(raw: dict, size: float) -> dict:
    sc = parse_scenario(overrides.apply(raw, "engine", "kv_offloading_size", size), SCENARIO)
    start = time.process_time()
    rec = engine.run(sc, build_requests(sc))
    s = metrics.summarize(sc, rec)
    ko = s["kv_offload"] or {}
    return {"kv_offloading_size": size, "num_cpu_chunks": ko.get("num_cpu_chunks", 0),
            "prompt_tokens": sum(r.num_prompt_tokens for r in rec.requests),
            "device_hit_tokens": s["prefix_cache_hits"],
            "host_hit_tokens": ko.get("external_prefix_cache_hits", 0),
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
            "ttft_mean_s": s["ttft_s"]["mean"], "e2e_mean_s": s["e2e_s"]["mean"],
            "load_gib": ko.get("kv_offload_load_bytes", 0) / GiB,
            "store_gib": ko.get("kv_offload_store_bytes", 0) / GiB,
            "num_preemptions": s["num_preemptions"], "cpu_s": time.process_time() - start}


def plot(rows: list[dict], png: Path, what: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['kv_offloading_size']:g}" for r in rows]
    x = range(len(rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
    dev = [100 * r["device_hit_tokens"] / r["prompt_tokens"] for r in rows]
    host = [100 * r["host_hit_tokens"] / r["prompt_tokens"] for r in rows]
    a.bar(x, dev, label="GPU prefix cache (device)")
    a.bar(x, host, bottom=dev, label="CPU tier (host)")
    a.set(xticks=list(x), xticklabels=labels, xlabel="kv_offloading_size, GiB",
          ylabel="prompt tokens served from cache, %", title="Hits by source")
    a.legend(loc="upper left", fontsize=8)
    b.plot(x, [r["ttft_p50_s"] for r in rows], "o-", label="p50")
    b.plot(x, [r["ttft_mean_s"] for r in rows], "s-", label="mean")
    b.plot(x, [r["ttft_p90_s"] for r in rows], "^-", label="p90")
    b.set(xticks=list(x), xticklabels=labels, xlabel="kv_offloading_size, GiB", ylabel="TTFT, s",
          title="Time to first token")
    b.legend(fontsize=8)
    w = 0.4
    c.bar([i - w / 2 for i in x], [r["store_gib"] for r in rows], w, label="stored (GPU to host)")
    c.bar([i + w / 2 for i in x], [r["load_gib"] for r in rows], w, label="loaded (host to GPU)")
    c.set(xticks=list(x), xticklabels=labels, xlabel="kv_offloading_size, GiB", ylabel="GiB",
          title="Offload traffic over the hour", yscale="log")
    c.legend(fontsize=8)
    fig.suptitle(f"Mooncake conversation hour, Llama-3.1-8B {what + ' ' if what else ''}on one "
                 "H100, vLLM 0.33.0 (roofline cost model, uncalibrated)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_GIB)), help="GiB, comma-separated")
    ap.add_argument("--eagle3", action="store_true", help="with EAGLE-3, 3 drafts a step")
    args = ap.parse_args()
    raw = tomllib.loads(SCENARIO.read_text())
    name = "cpu_offload"
    if args.eagle3:
        raw = overrides.apply(raw, "speculative", "method", "eagle3")
        raw = overrides.apply(raw, "speculative", "num_speculative_tokens", 3)
        name = "cpu_offload_eagle3"
    rows = [simulate(raw, float(s)) for s in args.sizes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plot(rows, args.out / f"{name}.png", "with EAGLE-3, 3 drafts" if args.eagle3 else "")
    print(f"{'GiB':>6} {'chunks':>8} {'GPU hit %':>10} {'CPU hit %':>10} {'TTFT p50':>9} "
          f"{'TTFT mean':>10} {'loaded GiB':>11} {'stored GiB':>11} {'CPU s':>7}")
    for r in rows:
        print(f"{r['kv_offloading_size']:>6g} {r['num_cpu_chunks']:>8,} "
              f"{100 * r['device_hit_tokens'] / r['prompt_tokens']:>10.1f} "
              f"{100 * r['host_hit_tokens'] / r['prompt_tokens']:>10.1f} {r['ttft_p50_s']:>9.2f} "
              f"{r['ttft_mean_s']:>10.2f} {r['load_gib']:>11,.0f} {r['store_gib']:>11,.0f} "
              f"{r['cpu_s']:>7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
