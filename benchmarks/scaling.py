"""How kvsim's wall time and memory grow with the number of requests (not a test).

    PYTHONPATH=$PWD python benchmarks/scaling.py [--sizes 1000 10000 100000 1000000]
    PYTHONPATH=$PWD python benchmarks/scaling.py --measure-capacity

Runs ``kvsim run`` on ``benchmarks/azure_conv.toml`` (Azure 2023 conversation lengths,
Poisson arrivals at 80 % of the replica's capacity) with ``num_requests`` set to each size,
each as the whole process a user starts (after one untimed warm-up run that byte-compiles
the modules, as an installed package has them; ``common.kvsim_env``), and prints wall time,
peak RSS, steps and simulated requests per wall-clock second. ``--measure-capacity`` instead
runs the scenario saturated (``request_rate = inf``, 10,000 requests) and prints its
throughput and 80 % of it: the ``request_rate`` the scenario file uses.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from common import kvsim_command, kvsim_env, timed

HERE = Path(__file__).resolve().parent


def run(scenario_text: str, work: Path, name: str, **keys) -> tuple[float, int, dict]:
    """``kvsim run`` on the scenario with workload ``keys`` replaced: (wall s, peak MiB, summary)."""
    for key, value in keys.items():
        scenario_text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", scenario_text)
        if n != 1:
            raise SystemExit(f"the scenario has no single {key} line")
    path = work / f"{name}.toml"
    path.write_text(scenario_text)
    out = work / name
    wall, rc, rss = timed([*kvsim_command(), "run", str(path), "--out", str(out), "-q"],
                          kvsim_env(work / "pycache"))
    if rc:
        raise SystemExit(f"kvsim run {path} failed (exit {rc})")
    return wall, rss, json.loads((out / "summary.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default=str(HERE / "azure_conv.toml"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000, 1000000])
    ap.add_argument("--measure-capacity", action="store_true")
    args = ap.parse_args()
    text = Path(args.scenario).read_text()
    with tempfile.TemporaryDirectory(prefix="kvsim-scaling-") as tmp:
        work = Path(tmp)
        if args.measure_capacity:
            wall, rss, s = run(text, work, "capacity", num_requests=10000, request_rate="inf")
            rate = s["throughput"]["requests_per_s"]
            print(f"saturated: {rate:.2f} requests/s over {s['sim_time_s']:.0f} s simulated "
                  f"({s['num_steps']} steps, {wall:.1f} s wall); 80 %: {0.8 * rate:.2f} requests/s")
            return 0
        run(text, work, "warm-up", num_requests=100)  # byte-compile kvsim and its imports once
        print(f"{'requests':>9} {'wall s':>8} {'peak MiB':>9} {'steps':>9} {'sim s':>9} "
              f"{'steps/s':>8} {'req/s':>7}")
        for n in args.sizes:
            wall, rss, s = run(text, work, f"n{n}", num_requests=n)
            print(f"{n:>9} {wall:>8.1f} {rss:>9} {s['num_steps']:>9} {s['sim_time_s']:>9.0f} "
                  f"{s['num_steps'] / wall:>8.0f} {n / wall:>7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
