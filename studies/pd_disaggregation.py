"""Prefill/decode disaggregation on the Mooncake conversation trace, at equal GPU count.

Runs ``scenarios/mooncake_conversation_pd.toml`` (Llama-3.1-8B on H100s, vLLM 0.33.0, the
trace's first ten minutes at ``--speedup``) once per layout: 2 aggregated replicas against
1P:1D, and 4 aggregated replicas against 1P:3D, 2P:2D and 3P:1D (prefix-aware routing on both
sides, NIXL reads over 400 Gb/s RDMA). Writes ``pd_disaggregation.csv`` and
``pd_disaggregation.png`` to ``--out``: TTFT, TPOT, goodput at a TTFT / TPOT SLO, and the KV
the decode instances pulled.

    python studies/pd_disaggregation.py --out plots/    # the trace must be in the trace cache
"""

from __future__ import annotations

import argparse
import csv
import time
import tomllib
from pathlib import Path

import numpy as np

from kvsim import engine, metrics, overrides
from kvsim.config import parse_scenario
from kvsim.model import GiB
from kvsim.workload import build_requests

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "mooncake_conversation_pd.toml"
# (label, GPUs, prefill instances or None for aggregated replicas, decode instances)
LAYOUTS = (("2 aggregated", 2, None, 2), ("1P:1D", 2, 1, 1),
           ("4 aggregated", 4, None, 4), ("1P:3D", 4, 1, 3), ("2P:2D", 4, 2, 2),
           ("3P:1D", 4, 3, 1))
COLUMNS = ("layout", "gpus", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_ms",
           "tpot_p90_ms", "goodput_req_s", "slo_share", "requests_per_s", "prefill_ttft_p50_s",
           "handover_p50_s", "pulled_gib", "read_p50_ms", "read_p99_ms", "prefix_hit_rate",
           "decode_hit_rate",
           "num_preemptions", "cpu_s")


def deployment(prefill: int | None, decode: int) -> list[dict]:
    if prefill is None:
        return [{"replicas": decode}]
    return [{"replicas": prefill, "kv_role": "kv_producer"},
            {"replicas": decode, "kv_role": "kv_consumer"}]


def simulate(raw: dict, layout: tuple, ttft_slo: float, tpot_slo: float) -> dict:
    label, gpus, prefill, decode = layout
    sc = parse_scenario(overrides.apply(raw, "cluster", "deployment", deployment(prefill, decode)),
                        SCENARIO)
    start = time.process_time()
    rec = engine.run(sc, build_requests(sc))
    s = metrics.summarize(sc, rec)
    pd = s.get("pd") or {}
    # Goodput as vllm bench serve counts it: finished requests within every SLO, per second
    # of the run.
    good = sum(1 for r in rec.requests if r.finish_s is not None and r.first_token_s is not None
               and r.first_token_s - r.arrival_s <= ttft_slo
               and (r.num_output_tokens < 2 or (r.finish_s - r.first_token_s)
                    / (r.num_output_tokens - 1) <= tpot_slo))
    x = pd.get("nixl_xfer_time_seconds")
    return {
        "layout": label, "gpus": gpus,
        "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
        "ttft_p99_s": s["ttft_s"]["p99"], "tpot_p50_ms": 1e3 * s["tpot_s"]["p50"],
        "tpot_p90_ms": 1e3 * s["tpot_s"]["p90"], "goodput_req_s": good / rec.end_s,
        "slo_share": good / len(rec.requests),
        "requests_per_s": s["throughput"]["requests_per_s"],
        "prefill_ttft_p50_s": pd["prefill_pool"]["ttft_s"]["p50"] if pd else None,
        "handover_p50_s": pd["prefill_to_first_token_s"]["p50"] if pd else None,
        "pulled_gib": pd["nixl_bytes_transferred"] / GiB if pd else 0.0,
        "read_p50_ms": 1e3 * x["p50"] if x else None, "read_p99_ms": 1e3 * x["p99"] if x else None,
        # The GPUs' own prefix caches (a decode instance's load counts as external, not here).
        "prefix_hit_rate": s["prefix_cache_hit_rate"],
        "decode_hit_rate": pd["decode_pool"]["prefix_cache_hit_rate"] if pd else None,
        "num_preemptions": s["num_preemptions"], "cpu_s": time.process_time() - start}


def plot(rows: list[dict], png: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["layout"] for r in rows]
    x = np.arange(len(rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2))
    w = 0.27
    for i, (q, name) in enumerate((("ttft_p50_s", "p50"), ("ttft_p90_s", "p90"),
                                   ("ttft_p99_s", "p99"))):
        a.bar(x + (i - 1) * w, [r[q] for r in rows], w, label=name)
    a.set(xticks=x, xticklabels=labels, ylabel="TTFT, s", yscale="log", title="Time to first token")
    a.legend(fontsize=8)
    b.bar(x - w / 2, [r["tpot_p50_ms"] for r in rows], w, label="p50")
    b.bar(x + w / 2, [r["tpot_p90_ms"] for r in rows], w, label="p90")
    b.set(xticks=x, xticklabels=labels, ylabel="TPOT, ms", title="Time per output token")
    b.legend(fontsize=8)
    c.bar(x, [100 * r["slo_share"] for r in rows], 0.6, color="tab:green")
    for i, r in enumerate(rows):
        if r["pulled_gib"]:
            c.annotate(f"{r['pulled_gib']:,.0f} GiB\npulled", (i, 100 * r["slo_share"]),
                       ha="center", va="bottom", fontsize=7)
    c.set(xticks=x, xticklabels=labels, ylabel="requests within the SLO, %", ylim=(0, 115),
          title="Goodput")
    for ax in (a, b, c):
        ax.axvline(1.5, color="grey", lw=0.8, ls=":")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--speedup", type=float, default=0.5,
                    help="the trace's rate multiplier (workload.speedup)")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.05, help="seconds")
    args = ap.parse_args()
    raw = overrides.apply(tomllib.loads(SCENARIO.read_text()), "workload", "speedup", args.speedup)
    rows = [simulate(raw, layout, args.ttft_slo, args.tpot_slo) for layout in LAYOUTS]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "pd_disaggregation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plot(rows, args.out / "pd_disaggregation.png",
         f"Mooncake conversation, first 10 min at {args.speedup:g}x, Llama-3.1-8B on H100s, "
         f"vLLM 0.33.0; SLO TTFT <= {args.ttft_slo:g} s, TPOT <= {1e3 * args.tpot_slo:g} ms "
         "(roofline cost model, uncalibrated)")
    print(f"{'layout':>13} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'TPOT p50':>9} {'p90':>6} "
          f"{'in SLO':>7} {'goodput':>8} {'pulled GiB':>11} {'read p99':>9} {'CPU s':>6}")
    for r in rows:
        print(f"{r['layout']:>13} {r['ttft_p50_s']:>9.2f} {r['ttft_p90_s']:>7.2f} "
              f"{r['ttft_p99_s']:>7.2f} {r['tpot_p50_ms']:>9.1f} {r['tpot_p90_ms']:>6.1f} "
              f"{100 * r['slo_share']:>6.1f}% {r['goodput_req_s']:>8.2f} {r['pulled_gib']:>11,.0f} "
              + (f"{r['read_p99_ms']:>7.1f}ms" if r["read_p99_ms"] is not None else f"{'-':>9}")
              + f" {r['cpu_s']:>6.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
