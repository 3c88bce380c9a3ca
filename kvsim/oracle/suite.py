"""The differential suite: seeded fuzzed traces through vLLM's Scheduler and kvsim, compared.

    python -m kvsim.oracle.suite --count 500                  # per version (CI's subset)
    python -m kvsim.oracle.suite --count 2000 --versions all  # every covered release
    python -m kvsim.oracle.suite --count 5000 --versions 0.33.0
    python -m kvsim.oracle.suite --count 2000 --mixes hybrid,spec-hybrid,mamba,spec-mamba

Scenarios cycle through the feature mixes each release supports (single group, speculative
decoding, hybrid groups, both, and asynchronous scheduling where kvsim models it), and P/D
pairs through ``pd_driver.py`` where kvsim reproduces NixlConnector (``--pd-count``); each
version's scenarios run in one oracle process (``vllm_driver.py`` in the environment that
``make_env.sh`` builds). A scenario vLLM refuses or cannot finish within the call cap is
counted apart; any mismatch fails the suite (exit 1) and is printed with its seed and mix, so
it can be replayed and turned into a regression case.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from kvsim.errors import ConfigError
from kvsim.oracle.fuzz import pd_to_driver, random_pd_scenario, random_scenario, to_driver
from kvsim.oracle.replay import build, compare, compare_pd, drive, drive_pd
from kvsim.oracle.validate import DRIVER, oracle_python
from kvsim.semantics import DEFAULT_VERSION, VERSIONS

# (speculative decoding, hybrid groups (True, or "mamba": with a Mamba group), asynchronous,
# native CPU offloading)
Mix = tuple[bool, bool | str, bool, bool]
MIXES: tuple[Mix, ...] = (
    (False, False, False, False), (True, False, False, False), (False, True, False, False),
    (True, True, False, False), (False, False, True, False), (True, True, True, False),
    (False, "mamba", False, False), (True, "mamba", False, False), (True, "mamba", True, False),
    (False, False, False, True), (False, False, True, True), (True, False, False, True),
    (True, False, True, True),
)


def mix_name(mix: tuple) -> str:
    """A mix as the fixture files name it: plain, spec, hybrid, spec-hybrid, mamba, async,
    offload, ..."""
    spec, hybrid, is_async, *rest = mix
    offload = bool(rest and rest[0])
    parts = [p for p, on in (("spec", spec), ("mamba" if hybrid == "mamba" else "hybrid", hybrid),
                             ("async", is_async), ("offload", offload)) if on]
    return "-".join(parts) or "plain"


def mixes_for(version: str, only: set[str] | None = None) -> list[Mix]:
    """The mixes this release supports (asynchronous ones where kvsim models its scheduler,
    offloading where it reproduces the connector), limited to the named ones (``mix_name``)
    when ``only`` is given."""
    return [m for m in MIXES if (not m[2] or VERSIONS[version].async_modelled)
            and (not m[3] or VERSIONS[version].offload is not None)
            and (only is None or mix_name(m) in only)]


STALL = re.compile(r"stall at step (\d+)")
PD_DRIVER = DRIVER.with_name("pd_driver.py")


def _run_driver(python: Path, driver: Path, scenarios: list[dict], version: str) -> list[dict]:
    """One oracle process over ``scenarios``: its results, one each."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps(scenarios))
        subprocess.run([str(python), str(driver), str(inp), str(out)], capture_output=True)
        results = json.loads(out.read_text()) if out.exists() else []
    if len(results) != len(scenarios):
        raise ConfigError("oracle", f"vLLM {version}'s {driver.name} returned {len(results)} "
                          f"results for {len(scenarios)} scenarios")
    return results


Tally = tuple[int, Counter, int, int, list[str]]


def run_version(version: str, count: int, first_seed: int, python: Path,
                max_calls: int, only: set[str] | None = None) -> Tally:
    """Returns (compared, how many of them ended in the release's own failure, by kind
    ("stall", "engine_dead"), mismatching, refused or unfinished by vLLM, first mismatch
    reports).

    A scenario in which vLLM deadlocks (schedule() schedules nothing, nothing is running)
    counts as compared when kvsim deadlocks at the same step, as a mismatch otherwise; one in
    which vLLM's engine dies (schedule() raises) is compared step by step up to that step,
    and the step and the exception must agree."""
    mixes = mixes_for(version, only)
    if not mixes:
        return 0, Counter(), 0, 0, []
    cases = []
    for i in range(count):
        seed = first_seed + i
        spec, hybrid, is_async, offload = mixes[i % len(mixes)]
        sc = random_scenario(seed, spec=spec, hybrid=hybrid, async_scheduling=is_async,
                             version=version, offload=offload)
        try:
            build(sc["engine"], version)
        except ConfigError:
            continue  # a configuration this release refuses at start-up
        cases.append((seed, (spec, hybrid, is_async, offload), sc))
    if not cases:
        return 0, Counter(), 0, 0, []
    results = _run_driver(python, DRIVER, [{**to_driver(sc), "max_schedule_calls": max_calls}
                                           for _, _, sc in cases], version)

    def check(sc: dict, res: dict) -> tuple[str | None, list[str]] | None:
        if "error" not in res or "engine_dead" in res:
            return ("engine_dead" if "engine_dead" in res else None), compare(
                drive(sc, version, check_invariants=False), res, limit=3)
        m = STALL.match(res["error"])
        if m is None:
            return None
        stall = int(m[1])
        got = drive(sc, version, check_invariants=False, max_steps=stall + 1)["stall"]
        return "stall", [] if got == stall else [f"vLLM deadlocks at step {stall}, kvsim: {got}"]
    return _tally(version, cases, results, mix_name, check)


def _tally(version: str, cases: list, results: list[dict], name, check) -> Tally:
    """(compared, of which ending in the release's own failure by kind, mismatching, refused,
    first mismatch reports) of the cases ``(seed, mix, scenario)`` and their oracle results,
    by ``check(scenario, result)``: None if vLLM refused it, else (how vLLM's run ended
    early, if it did: "stall" or "engine_dead", the mismatches)."""
    compared = bad = refused = 0
    endings: Counter = Counter()
    reports: list[str] = []
    for (seed, mix, sc), res in zip(cases, results):
        got = check(sc, res)
        if got is None:
            refused += 1
            continue
        ending, mismatches = got
        compared += 1
        if ending is not None:
            endings[ending] += 1
        if mismatches:
            bad += 1
            if len(reports) < 10:
                reports.append(f"{version} seed {seed} {name(mix)}: " + "; ".join(mismatches))
    return compared, endings, bad, refused, reports


# P/D pairs (oracle/pd_driver.py: two Schedulers with NixlConnector): (speculative, asynchronous).
PD_MIXES: tuple[tuple[bool, bool], ...] = ((False, False), (True, False), (False, True),
                                           (True, True))


def pd_mix_name(mix: tuple[bool, bool]) -> str:
    return "-".join(["pd"] + [p for p, on in zip(("spec", "async"), mix) if on])


def run_version_pd(version: str, count: int, first_seed: int, python: Path,
                   only: set[str] | None = None) -> Tally:
    """``run_version`` for P/D pairs, on releases whose NixlConnector kvsim reproduces; a
    pair that deadlocks counts as compared when kvsim's deadlocks at the same tick."""
    mixes = [m for m in PD_MIXES if only is None or pd_mix_name(m) in only]
    if not VERSIONS[version].nixl_pd or not mixes:
        return 0, Counter(), 0, 0, []
    cases = []
    for i in range(count):
        seed = first_seed + i
        spec, is_async = mixes[i % len(mixes)]
        sc = random_pd_scenario(seed, spec=spec, async_scheduling=is_async)
        try:
            build(sc["prefill"], version)
            build(sc["decode"], version)
        except ConfigError:
            continue
        cases.append((seed, (spec, is_async), sc))
    if not cases:
        return 0, Counter(), 0, 0, []
    results = _run_driver(python, PD_DRIVER, [pd_to_driver(sc) for _, _, sc in cases], version)

    def check(sc: dict, res: dict) -> tuple[str | None, list[str]] | None:
        if "error" in res and res.get("stall") is None:
            return None
        return ("stall" if res.get("stall") is not None else None), compare_pd(
            drive_pd(pd_to_driver(sc), version, check_invariants=False), res, limit=3)
    return _tally(version, cases, results, pd_mix_name, check)


def ci_versions(turn: int, others: int = 3) -> list[str]:
    """CI's releases at its ``turn``-th run (the commit count): the newest, and ``others`` of
    the rest taken in turn, so that every covered release runs once every
    ``ceil((len(VERSIONS) - 1) / others)`` commits."""
    rest = [v for v in VERSIONS if v != DEFAULT_VERSION]
    if not rest:
        return [DEFAULT_VERSION]
    start = turn * others % len(rest)
    return [DEFAULT_VERSION] + [rest[(start + i) % len(rest)] for i in range(min(others, len(rest)))]


def resolve_versions(arg: str, turn: int | None = None) -> list[str]:
    """``--versions``: a comma-separated list of covered releases, ``all``, or ``ci`` (the
    newest and a subset that rotates with ``turn``, by default the commit count of HEAD)."""
    if arg == "all":
        return list(VERSIONS)
    if arg == "ci":
        if turn is None:
            turn = _commit_count()
        return ci_versions(turn)
    versions = arg.split(",")
    unknown = [v for v in versions if v not in VERSIONS]
    if unknown:
        raise ConfigError("--versions", f"not a covered release: {', '.join(unknown)} "
                          f"(covered: {', '.join(VERSIONS)}, or all, ci)")
    return versions


def _commit_count() -> int:
    """HEAD's commit count in the checkout holding this file (0 outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-list", "--count", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, check=True).stdout
        return int(out)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvsim.oracle.suite")
    ap.add_argument("--versions", default="ci",
                    help="covered releases, comma-separated; 'all'; or 'ci' (default): the "
                         "newest and three others in turn by HEAD's commit count")
    ap.add_argument("--list", action="store_true",
                    help="print the releases --versions names, one a line, and exit")
    ap.add_argument("--count", type=int, default=500, help="scenarios per version")
    ap.add_argument("--first-seed", type=int, default=100_000)
    ap.add_argument("--max-calls", type=int, default=20_000, help="schedule() calls per scenario")
    ap.add_argument("--pd-count", type=int, default=None,
                    help="P/D pairs per version (default: a quarter of --count)")
    names = sorted({mix_name(m) for m in MIXES} | {pd_mix_name(m) for m in PD_MIXES})
    ap.add_argument("--mixes", default=None,
                    help=f"only these feature mixes, comma-separated ({', '.join(names)})")
    args = ap.parse_args(argv)
    try:
        versions = resolve_versions(args.versions)
    except ConfigError as exc:
        print(f"kvsim: error: {exc.where}: {exc.what}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(versions))
        return 0
    only = None
    if args.mixes is not None:
        only = set(args.mixes.split(","))
        if only - set(names):
            print(f"kvsim: error: --mixes: unknown {', '.join(sorted(only - set(names)))} "
                  f"(known: {', '.join(names)})", file=sys.stderr)
            return 2
    pd_count = args.count // 4 if args.pd_count is None else args.pd_count
    total_bad = total = 0
    for version in versions:
        for what, count in (("traces", args.count), ("P/D pairs", pd_count)):
            try:
                python = oracle_python(version, None)
                t0 = time.perf_counter()
                if what == "traces":
                    compared, endings, bad, refused, reports = run_version(
                        version, count, args.first_seed, python, args.max_calls, only)
                    expected = bool(mixes_for(version, only))
                else:
                    compared, endings, bad, refused, reports = run_version_pd(
                        version, count, args.first_seed, python, only)
                    expected = VERSIONS[version].nixl_pd and any(
                        only is None or pd_mix_name(m) in only for m in PD_MIXES)
            except ConfigError as exc:
                print(f"kvsim: error: {exc.where}: {exc.what}", file=sys.stderr)
                return 2
            if not expected:
                continue
            if count and not compared:
                # Every scenario refused: the driver itself failed (e.g. an engine default
                # it does not reproduce), which must not pass as "0 mismatching".
                print(f"vLLM {version}: no {what} compared, {refused} refused", file=sys.stderr)
                total_bad += 1
            total += compared
            total_bad += bad
            print(f"vLLM {version}: {compared} {what} compared ({endings['stall']} ending in "
                  f"vLLM's own deadlock, {endings['engine_dead']} in its engine's death), "
                  f"{bad} mismatching, {refused} refused or unfinished by vLLM "
                  f"({time.perf_counter() - t0:.0f} s)")
            for r in reports:
                print("  " + r[:400])
    print(f"differential: {total - total_bad} passed, {total_bad} failed")
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
