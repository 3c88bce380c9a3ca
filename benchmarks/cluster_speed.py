"""A prefix-aware cluster against one engine at the same per-replica load (not a test).

    KVSIM_TRACE_DIR=/work/shared/data PYTHONPATH=$PWD python benchmarks/cluster_speed.py \\
        [--replicas 8 16] [--repeats 3] [--eagle] [--workers N]

The Mooncake FAST'25 conversation hour (12,031 requests) on Llama-3.1-8B / H100 with vLLM
0.33.0's defaults: once on one engine at the trace's own rate, and on N prefix-aware replicas
with the hour sped up N times, so that each replica is as loaded as the one engine. Each is
the whole ``kvsim run`` process (modules byte-compiled, one untimed warm-up run first; the
settings take turns, each run of each, as the machine's speed drifts); it
prints wall time, simulated requests per wall-clock second and steps, and each cluster's
requests per wall second over the one engine's; ``--eagle`` adds speculative decoding to
both. A cluster runs as ``kvsim run`` runs it: its replicas on all cores
(``--workers N``: on N processes; 1: on one, as before ``kvsim.parallel``). Skips (exit 0)
without the trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import kvsim_command, kvsim_env, timed

SCENARIO = """\
[model]
preset = "llama-3.1-8b"
[hardware]
preset = "h100-sxm"
[engine]
vllm_version = "0.33.0"
block_size = 16
enable_prefix_caching = true
[workload]
kind = "trace"
trace = "mooncake-conversation"
speedup = {speedup}
[run]
seed = 0
{speculative}{cluster}"""

# --eagle: EAGLE with 3 drafts, 2 of them accepted at every verify step.
EAGLE = """\
[speculative]
method = "eagle"
num_speculative_tokens = 3
acceptance = "fixed"
num_accepted = 2
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting, settings taking "
                    "turns (median)")
    ap.add_argument("--workers", type=int, default=None,
                    help="kvsim run --workers for the clusters (default: kvsim's, all cores)")
    ap.add_argument("--eagle", action="store_true",
                    help="with EAGLE, 3 drafts of which 2 are accepted per verify step")
    args = ap.parse_args()

    from kvsim.errors import ConfigError
    from kvsim.traces import locate

    try:
        locate("mooncake-conversation")
    except ConfigError as e:
        print(f"skipped: {e}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="kvsim-cluster-"))
    env = kvsim_env(work / "pycache")
    settings = [1, *args.replicas]
    cmds = {}
    for n in settings:
        cluster = "" if n == 1 else f'[cluster]\nreplicas = {n}\nrouter = "prefix_aware"\n'
        path = work / f"c{n}.toml"
        path.write_text(SCENARIO.format(speedup=float(n), cluster=cluster,
                                        speculative=EAGLE if args.eagle else ""))
        cmds[n] = [*kvsim_command(), "run", str(path), "--out", str(work / f"o{n}"), "-q", "--force"]
        if n > 1 and args.workers is not None:
            cmds[n] += ["--workers", str(args.workers)]
    timed(cmds[1], env)  # warm-up
    # Settings take turns, repeat by repeat: the machine's speed drifts over minutes.
    walls: dict[int, list[float]] = {n: [] for n in settings}
    peaks = dict.fromkeys(settings, 0)
    for _ in range(args.repeats):
        for n in settings:
            wall, rc, rss = timed(cmds[n], env)
            if rc:
                print(f"{n} replicas: kvsim run failed")
                return 1
            walls[n].append(wall)
            peaks[n] = max(peaks[n], rss)
    rows = []
    for n in settings:
        summary = json.loads((work / f"o{n}" / "summary.json").read_text())
        rows.append((n, walls[n], statistics.median(walls[n]), peaks[n], summary["num_requests"],
                     summary["num_steps"]))
        print(f"{n} replica(s): " + ", ".join(f"{w:.1f}" for w in walls[n]) + " s", flush=True)
    base = rows[0][4] / rows[0][2]
    print(f"{'replicas':>8} {'speedup':>7} {'wall s':>7} {'req/s':>7} {'steps':>8} "
          f"{'peak MiB':>8} {'req/s vs one engine':>20}")
    for n, _, wall, rss, reqs, steps in rows:
        print(f"{n:>8} {n:>6}x {wall:>7.1f} {reqs / wall:>7.0f} {steps:>8} {rss:>8} "
              f"{reqs / wall / base:>19.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
