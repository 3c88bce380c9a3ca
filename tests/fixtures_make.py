"""Regenerate tests/fixtures/vllm-<version>.json.gz: fuzzed scenarios and vLLM's own results.

Needs an oracle environment (kvsim/oracle/make_env.sh VERSION):

    python tests/fixtures_make.py --python ~/.cache/kvsim/oracle/vllm-0.33.0/bin/python \
        --version 0.33.0 --count 120

Re-record every scenario of existing fixtures (after a change to the driver), keeping the
scenarios themselves:

    python tests/fixtures_make.py --python ... --version 0.33.0 --rerecord

The expected numbers in the fixture come from vLLM's Scheduler, never from kvsim;
tests/test_vllm_fixtures.py replays each scenario through kvsim and requires identity.
"""

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvsim.oracle.fuzz import pd_to_driver, random_pd_scenario, random_scenario, to_driver  # noqa: E402
from kvsim.oracle.replay import block_ids_digest  # noqa: E402
from kvsim.oracle.suite import mix_name, mixes_for  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", required=True, help="the oracle environment's python")
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--count", type=int, default=120)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--driver", default=str(ROOT / "kvsim/oracle/vllm_driver.py"))
    ap.add_argument("--spec", action="store_true", help="with speculative decoding")
    ap.add_argument("--hybrid", action="store_true", help="with hybrid KV groups")
    ap.add_argument("--mamba", action="store_true", help="hybrid KV groups with a Mamba group")
    ap.add_argument("--async", dest="async_", action="store_true", help="asynchronous scheduling")
    ap.add_argument("--offload", action="store_true", help="native CPU offloading (0.33)")
    ap.add_argument("--pd", action="store_true",
                    help="P/D pairs through kvsim/oracle/pd_driver.py (with --spec, --async), "
                         "into pd-vllm-VERSION[-spec][-async]")
    ap.add_argument("--all-mixes", action="store_true",
                    help="every feature mix the release supports in turn, as the differential "
                         "suite cycles them, into vllm-VERSION-mixes")
    ap.add_argument("--cases", nargs="*", metavar="SEED[:MIX]",
                    help="record these seeds (MIX: spec,hybrid|mamba,async,offload) into "
                         "vllm-VERSION-regressions (added to the cases there)")
    ap.add_argument("--rerecord", action="store_true",
                    help="run the scenarios of every tests/fixtures/vllm-VERSION*.json.gz again")
    args = ap.parse_args()
    if args.pd:
        scenarios = [random_pd_scenario(s, spec=args.spec, async_scheduling=args.async_)
                     for s in range(args.first_seed, args.first_seed + args.count)]
        tag = "".join(t for t, on in (("-spec", args.spec), ("-async", args.async_)) if on)
        write(ROOT / "tests" / "fixtures" / f"pd-vllm-{args.version}{tag}.json.gz",
              {"vllm_version": args.version, "generator": "kvsim.oracle.fuzz.random_pd_scenario",
               "cases": record_pd(args, scenarios)})
        return 0
    if args.rerecord:
        for dest in sorted((ROOT / "tests" / "fixtures").glob(f"vllm-{args.version}*.json.gz")):
            data = json.loads(gzip.decompress(dest.read_bytes()))
            scenarios = [c["scenario"] for c in data["cases"]]
            data["cases"] = record(args, scenarios)
            write(dest, data)
        return 0
    if args.all_mixes:
        mixes = mixes_for(args.version)
        scenarios = []
        for i, seed in enumerate(range(args.first_seed, args.first_seed + args.count)):
            spec, hybrid, is_async, offload = mixes[i % len(mixes)]
            scenarios.append(random_scenario(seed, spec=spec, hybrid=hybrid, version=args.version,
                                             async_scheduling=is_async, offload=offload))
        write(ROOT / "tests" / "fixtures" / f"vllm-{args.version}-mixes.json.gz",
              {"vllm_version": args.version, "generator": "kvsim.oracle.fuzz",
               "mixes": [mix_name(m) for m in mixes], "cases": record(args, scenarios)})
        return 0
    if args.cases:
        scenarios = []
        for item in args.cases:
            seed, _, mix = item.partition(":")
            flags = set(mix.split(",")) if mix else set()
            hybrid = "mamba" if "mamba" in flags else "hybrid" in flags
            scenarios.append(random_scenario(int(seed), spec="spec" in flags, hybrid=hybrid,
                                             version=args.version,
                                             async_scheduling="async" in flags,
                                             offload="offload" in flags))
    else:
        hybrid = "mamba" if args.mamba else args.hybrid
        scenarios = [random_scenario(s, spec=args.spec, hybrid=hybrid, async_scheduling=args.async_,
                                     version=args.version, offload=args.offload)
                     for s in range(args.first_seed, args.first_seed + args.count)]
    tag = "-regressions" if args.cases else "".join(
        t for t, on in (("-spec", args.spec), ("-hybrid", args.hybrid), ("-mamba", args.mamba),
                        ("-async", args.async_), ("-offload", args.offload)) if on)
    dest = ROOT / "tests" / "fixtures" / f"vllm-{args.version}{tag}.json.gz"
    if args.cases and dest.exists():  # regressions accumulate: replace same seeds, keep the rest
        data = json.loads(gzip.decompress(dest.read_bytes()))
        new = record(args, scenarios)
        seeds = {c["scenario"]["seed"] for c in new}
        data["cases"] = [c for c in data["cases"] if c["scenario"]["seed"] not in seeds] + new
        write(dest, data)
        return 0
    write(dest, {"vllm_version": args.version, "generator": "kvsim.oracle.fuzz",
                 "spec": args.spec, "hybrid": "mamba" if args.mamba else args.hybrid,
                 "async": args.async_, "cases": record(args, scenarios)})
    return 0


def record(args, scenarios: list[dict]) -> list[dict]:
    """The scenarios with vLLM's results (those vLLM refuses are left out, and named; a run
    in which the release's engine dies is kept, up to that step)."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps([to_driver(s) for s in scenarios]))
        subprocess.run([args.python, args.driver, str(inp), str(out)],
                       check=False)
        results = json.loads(out.read_text())
    cases = []
    for sc, res in zip(scenarios, results, strict=True):
        if "error" in res and "engine_dead" not in res:
            print(f"seed {sc['seed']}: {res['error'][:200]}", file=sys.stderr)
            continue
        res.pop("usage", None)
        for st in res["steps"]:
            st.pop("usage", None)  # recomputable from num_free_blocks
            st["block_ids_digest"] = block_ids_digest(st.pop("block_ids"))
        cases.append({"scenario": sc, "vllm": res})
    return cases


def record_pd(args, scenarios: list[dict]) -> list[dict]:
    """P/D pairs with vLLM's results (a pair vLLM deadlocks is kept, with its tick)."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps([pd_to_driver(s) for s in scenarios]))
        subprocess.run([args.python, str(ROOT / "kvsim/oracle/pd_driver.py"), str(inp), str(out)],
                       check=False)
        results = json.loads(out.read_text())
    cases = []
    for sc, res in zip(scenarios, results, strict=True):
        if "error" in res and res.get("stall") is None:
            print(f"seed {sc['seed']}: {res['error'][:200]}", file=sys.stderr)
            continue
        for side in ("prefill", "decode"):
            for st in res[side]["steps"]:
                st.pop("usage", None)
                st["block_ids_digest"] = block_ids_digest(st.pop("block_ids"))
        cases.append({"scenario": sc, "vllm": res})
    return cases


def write(dest: Path, data: dict) -> None:
    dest.parent.mkdir(exist_ok=True)
    text = json.dumps(data, separators=(",", ":")) + "\n"
    dest.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    print(f"{len(data['cases'])} cases -> {dest} ({dest.stat().st_size} bytes)")


if __name__ == "__main__":
    sys.exit(main())
