"""Fit the roofline's per-generation constants (kvsim/presets/roofline.toml) on InferenceX.

A coordinate search over the five constants of one GPU generation (compute_efficiency,
moe_compute_efficiency, bandwidth_efficiency, step_overhead_s, frontend_latency_s), shared by
every model of that generation, minimising the sum of the median |error| of mean TTFT and of
mean TPOT over the generation's vLLM points (benchmarks/timing_accuracy.py builds each point
from its own settings). A sample of the points keeps each evaluation short (``--every``: one
point in N, the concurrencies alternating). Prints the constants and the TOML table to paste;
the B300 runs are not in the shared data (held out).

    python calibration/fit_inferencex.py --gpus h100,h200 --capability 9.0 [--every 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from timing_accuracy import err, points, predict, scenario_for, shared_data  # noqa: E402

from kvsim.config import roofline_constants  # noqa: E402
from kvsim.errors import ConfigError  # noqa: E402

STEPS = {"compute_efficiency": (0.8, 1.25), "moe_compute_efficiency": (0.7, 1.4),
         "bandwidth_efficiency": (0.9, 1.1), "step_overhead_s": (0.6, 1.6),
         "frontend_latency_s": (0.75, 1.3)}
HIGH = {"compute_efficiency": 1.0, "moe_compute_efficiency": 1.0, "bandwidth_efficiency": 1.0}


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


def score(pts, constants: dict) -> float:
    e_ttft, e_tpot = [], []
    for raw, ttft, tpot in pts:
        try:
            p = predict({**raw, "cost": dict(constants)})
        except ConfigError:
            continue
        e_ttft.append(abs(err(p["ttft"], ttft)))
        e_tpot.append(abs(err(p["tpot"], tpot)))
    return statistics.median(e_ttft) + statistics.median(e_tpot)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", required=True, help="comma-separated InferenceX GPU names")
    ap.add_argument("--capability", required=True, help="their compute capability (the table)")
    ap.add_argument("--every", type=int, default=3, help="one point in N (default 3)")
    ap.add_argument("--prompts-per-concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    pts = sample(set(args.gpus.split(",")), args.every, args.prompts_per_concurrency)
    if not pts:
        print("no points (is the shared data there?)")
        return 0
    best = dict(roofline_constants(args.capability))
    best_score = score(pts, best)
    print(f"{len(pts)} points; start {best_score:.1f}: {best}", flush=True)
    for _ in range(args.rounds):
        for key, factors in STEPS.items():
            for f in factors:
                trial = {**best, key: min(best[key] * f, HIGH.get(key, float("inf")))}
                s = score(pts, trial)
                if s < best_score:
                    best, best_score = trial, s
                    print(f"  {key} -> {trial[key]:.4g}: {s:.1f}", flush=True)
    print(f"\nfitted ({best_score:.1f}):\n[\"{args.capability}\"]")
    for key, value in best.items():
        print(f"{key} = {value:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
