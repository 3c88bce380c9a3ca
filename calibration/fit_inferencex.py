"""Fit the roofline's per-generation constants (kvsim/presets/roofline.toml) on InferenceX.

A coordinate search over the seven constants of one GPU generation (the keys of
kvsim/presets/roofline.toml), shared by every model of that generation, minimising the median
|error| of mean TTFT plus that of mean TPOT, plus a quarter of their 90th percentiles, over
the generation's vLLM points (benchmarks/timing_accuracy.py builds each point from its own
settings). A sample of the points keeps each evaluation short (``--every``: one point in N,
the concurrencies alternating), run in ``--jobs`` processes. Prints the constants and the TOML
table to paste; the B300 runs are not in the shared data (held out).

    python calibration/fit_inferencex.py --gpus h100,h200 --capability 9.0 [--every 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from timing_accuracy import err, points, predict_all, scenario_for, shared_data  # noqa: E402

from kvsim.config import roofline_generation  # noqa: E402

# Multiplicative steps of the search; a constant at 0 steps to its FLOOR first.
STEPS = {"compute_efficiency": (0.8, 1.25), "moe_compute_efficiency": (0.7, 1.4),
         "bandwidth_efficiency": (0.9, 1.1), "attention_bandwidth_efficiency": (0.7, 1.3),
         "step_overhead_s": (0.6, 1.6), "step_overhead_per_request_s": (0.5, 2.0),
         "frontend_latency_s": (0.75, 1.3)}
FLOOR = {"step_overhead_per_request_s": 2e-5, "step_overhead_s": 2e-4}
HIGH = {"compute_efficiency": 1.0, "moe_compute_efficiency": 1.0, "bandwidth_efficiency": 1.0,
        "attention_bandwidth_efficiency": 1.0}


def sample(gpus: set[str], every: int, prompts: int):
    out = []
    for i, (sw, c, ttft, tpot, passed, version) in enumerate(points(shared_data())):
        if sw["gpu"] not in gpus or i % every:
            continue
        try:
            out.append((scenario_for(sw, c, passed, version, prompts), ttft, tpot))
        except KeyError:
            continue
    return out


def score(pts, constants: dict, jobs: int) -> float:
    e_ttft, e_tpot = [], []
    preds = predict_all([{**raw, "cost": dict(constants)} for raw, _, _ in pts], jobs)
    for (_, ttft, tpot), p in zip(pts, preds):
        if isinstance(p, str):  # refused: as bad as the worst
            e_ttft.append(100.0)
            e_tpot.append(100.0)
            continue
        e_ttft.append(abs(err(p["ttft"], ttft)))
        e_tpot.append(abs(err(p["tpot"], tpot)))

    def p90(xs):
        return statistics.quantiles(xs, n=10)[-1]

    return (statistics.median(e_ttft) + statistics.median(e_tpot)
            + (p90(e_ttft) + p90(e_tpot)) / 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", required=True, help="comma-separated InferenceX GPU names")
    ap.add_argument("--capability", required=True, help="their compute capability (the start: "
                    "the table listing it in kvsim/presets/roofline.toml, else [default])")
    ap.add_argument("--every", type=int, default=3, help="one point in N (default 3)")
    ap.add_argument("--prompts-per-concurrency", type=int, default=10,
                    help="requests per unit of concurrency (InferenceX: 10; fewer biases TTFT)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    pts = sample(set(args.gpus.split(",")), args.every, args.prompts_per_concurrency)
    if not pts:
        print("no points (is the shared data there?)")
        return 0
    generation, best = roofline_generation(args.capability)
    best_score = score(pts, best, args.jobs)
    print(f"{len(pts)} points; start {best_score:.1f}: {best}", flush=True)
    for _ in range(args.rounds):
        for key, factors in STEPS.items():
            for f in factors:  # a line search: on in a direction while it helps
                moved = False
                while True:
                    value = best[key] * f if best[key] else FLOOR.get(key, 0.0)
                    trial = {**best, key: min(value, HIGH.get(key, float("inf")))}
                    if trial == best:
                        break
                    s = score(pts, trial, args.jobs)
                    if s >= best_score:
                        break
                    best, best_score, moved = trial, s, True
                    print(f"  {key} -> {trial[key]:.4g}: {s:.1f}", flush=True)
                if moved:
                    break  # the other direction cannot help from here
    print(f"\nfitted ({best_score:.1f}), from the table of {generation}:")
    for key, value in best.items():
        print(f"{key} = {value:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
