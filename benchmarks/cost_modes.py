"""The two step-time models where vLLM layer profiles exist, side by side in one run.

1. Held-out profile rows: for every profile folder (and tensor parallel size), a seeded fifth
   of ``attention.csv``'s grid points is left out; the interpolated model is built from the
   rest and the fitted form fitted to the rest's composed rows; both predict the left-out
   points' composed target passes (the measured attention with the same dense layers), and
   the table gives |predicted / measured - 1| (``kvsim.calibrate.llmservingsim.heldout_errors``;
   the fitted form predicts by the run-time path, ``GridStep.fitted_s``).
   Then the fitted form off its slice: fitted to the grid's steps of at most 1,024 tokens and
   8,192 tokens of context, scored on the others (``offslice_errors``): extrapolation, which
   is what the interpolated model uses it for past its grid.
2. Measured runs: every run replayed with each model, with its default step overhead and
   with the overhead fitted per GPU on the other runs of that GPU (leave one out; a GPU with
   one run has none), beside the peer's own errors.

    KVSIM_SHARED_DATA=../shared/data python benchmarks/cost_modes.py [EXTRA_ROOT ...]

Each ``EXTRA_ROOT`` is another LLMServingSim tree, laid out as ../shared/data/llmservingsim
(``profiles/``, ``runs/``, ``workloads/``) or as LLMServingSim's repository (``profiler/perf/``,
``bench/examples/``, ``workloads/``): a GPU whose data is not in ../shared/data. Prints
Markdown tables.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from kvsim import measured
from kvsim.calibrate import fit, llmservingsim
from kvsim.cost.interpolated import read_meta, tp_degrees
from kvsim.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVSIM_SHARED_DATA", ROOT.parent / "shared" / "data"))


# (profiles, runs) folders of the two layouts
LAYOUTS = (("profiles", "runs"), ("profiler/perf", "bench/examples"))


def trees(extra: list[str]) -> list[Path]:
    roots = [SHARED / "llmservingsim", *map(Path, extra)]
    return [r for r in roots if any((r / a).is_dir() or (r / b).is_dir() for a, b in LAYOUTS)]


def profile_folders(root: Path) -> list[tuple[Path, Path]]:
    """(folder, the profiles folder it is under)."""
    return sorted((p.parent, root / a) for a, _ in LAYOUTS for p in (root / a).glob("*/*/*/*/meta.yaml"))


def stats(errors: np.ndarray) -> tuple[float, float, float]:
    """Median, p90 and max |error| (%) of ``predicted / measured - 1`` values."""
    e = np.abs(errors) * 100
    return float(np.median(e)), float(np.percentile(e, 90)), float(np.max(e))


def heldout(folder: Path, tp: int, seed: int = 0) -> dict | None:
    """Median, p90 and max |predicted / measured - 1| (%) of both models on the folder's
    held-out grid points (``llmservingsim.heldout_errors``), and their count; None for a model
    kvsim has no preset for."""
    if llmservingsim.preset_for(read_meta(folder).get("model", "")) is None:
        return None
    res = llmservingsim.heldout_errors(folder, tp, seed=seed)
    return {"n": res["n"], "interpolated": stats(res["interpolated"]), "fitted": stats(res["fitted"])}


# The off-slice check: the fitted form fitted to the grid's steps of at most this many tokens
# and this much context, scored on the rest (what the interpolated model uses it for past its grid).
SLICE_TOKENS, SLICE_CONTEXT = 1024, 8192


def profile_cases(roots: list[Path]) -> list[tuple[Path, Path, int]]:
    """(folder, the profiles folder it is under, tp) of every profile; a GPU's data in two
    trees counts once (the first)."""
    seen, out = set(), []
    for root in roots:
        for folder, under in profile_folders(root):
            if folder.relative_to(under) not in seen:
                seen.add(folder.relative_to(under))
                out += [(folder, under, tp) for tp in tp_degrees(folder)]
    return out


def runs_of(root: Path) -> list[Path]:
    return sorted(p.parent.parent for _, b in LAYOUTS for p in (root / b).glob("*/*/vllm/meta.json"))


def fitted_profile(run: Path, tmp: Path) -> str:
    """A fitted profile for the run's GPU: the shipped one, else fitted to the run's layer profiles."""
    r = measured.load_run(run)
    tp = int(r.meta["engine_kwargs"].get("tensor_parallel_size", 1))
    try:
        return measured.shipped_profile_for(r.model, r.hardware_name, tp)
    except ConfigError:
        assert r.layer_profile is not None
        rows, prov = llmservingsim.step_rows(r.layer_profile, tp)
        csv = tmp / f"{run.parent.name}-{run.name}.csv"
        fit.write_csv(rows, csv)
        out = csv.with_suffix(".json")
        fit.write_profile(fit.build_profile(csv, provenance=prov), out)
        return str(out)


def errors(run: Path, profile: str | None, overhead: float | None) -> dict:
    over = {} if overhead is None else {"cost": {"step_overhead_s": overhead}}
    sc, _, _, table = measured.compare(run, profile, over)
    out = {(t["metric"], t["stat"]): t["diff_pct"] for t in table}
    peer = {(t["metric"], t["stat"]): t["peer_diff_pct"] for t in table}
    return {"kvsim": out, "peer": peer, "overhead_ms": sc.cost.step_overhead_s * 1e3}


def main(extra: list[str]) -> None:
    roots = trees(extra)
    profiles = profile_cases(roots)
    print("## Held-out profile rows (a seeded fifth of attention.csv's grid, composed target passes)\n")
    print("| profile | tp | held-out rows | interpolated median / p90 / max | fitted median / p90 / max |")
    print("|---|---|---|---|---|")
    composed = []
    for folder, under, tp in profiles:
        try:
            res = heldout(folder, tp)
        except ConfigError as exc:  # e.g. an MoE model's tp without moe.csv
            print(f"| {folder.relative_to(under)} | {tp} | — | not composed: "
                  f"{Path(exc.where).name}: {exc.what} | |")
            continue
        if res is None:
            continue
        composed.append((folder, under, tp))
        i, f = res["interpolated"], res["fitted"]
        print(f"| {folder.relative_to(under)} | {tp} | {res['n']} | "
              f"{i[0]:.1f} / {i[1]:.1f} / {i[2]:.0f} % | {f[0]:.1f} / {f[1]:.1f} / {f[2]:.0f} % |",
              flush=True)
    print(f"\n## The fitted form off its slice (fitted to the grid's steps of <= {SLICE_TOKENS} tokens "
          f"and <= {SLICE_CONTEXT} tokens of context, scored on all the others)\n")
    print("| profile | tp | rows fitted to | rows scored | fitted median / p90 / max |")
    print("|---|---|---|---|---|")
    for folder, under, tp in composed:
        off = llmservingsim.offslice_errors(folder, tp, SLICE_TOKENS, SLICE_CONTEXT)
        f = stats(off["fitted"])
        print(f"| {folder.relative_to(under)} | {tp} | {off['num_fitted']} | {off['n']} | "
              f"{f[0]:.1f} / {f[1]:.1f} / {f[2]:.0f} % |", flush=True)
    runs = list({(r.parent.name, r.name): r for root in reversed(roots) for r in runs_of(root)}.values())
    by_gpu: dict[str, list[Path]] = {}
    for run in runs:
        by_gpu.setdefault(run.parent.name, []).append(run)
    with tempfile.TemporaryDirectory() as tmp:
        fitted: dict[Path, str | None] = {run: fitted_profile(run, Path(tmp)) for run in runs}
        interp: dict[Path, str | None] = dict.fromkeys(runs)
        print("\n## Measured runs: error of TTFT mean / median / P99 / TPOT mean (%), and the mean "
              "|error| over all 15 metrics\n")
        print("| run | model | step overhead | TTFT mean | TTFT median | TTFT P99 | TPOT mean | "
              "mean abs, 15 metrics |")
        print("|---|---|---|---|---|---|---|---|")
        for run in runs:
            others = [r for r in by_gpu[run.parent.name] if r != run]
            name = f"{run.parent.name}/{run.name}"
            for label, by_run in (("interpolated", interp), ("fitted", fitted)):
                cases: list[tuple[str, float | None]] = [("default", None)]
                if others:
                    fitted_s, _ = measured.fit_step_overhead(others, by_run)
                    cases.append(("fitted on the GPU's other runs", fitted_s))
                for how, overhead in cases:
                    e = errors(run, by_run[run], overhead)
                    k = e["kvsim"]
                    cells = " | ".join(f"{k[m]:+.1f}" for m in measured.KEY_METRICS)
                    print(f"| {name} | {label} | {e['overhead_ms']:.2f} ms ({how}) | {cells} | "
                          f"{np.mean(np.abs(list(k.values()))):.1f} |", flush=True)
            p = e["peer"]
            if all(v is not None for v in p.values()):
                cells = " | ".join(f"{p[m]:+.1f}" for m in measured.KEY_METRICS)
                print(f"| {name} | peer (LLMServingSim) | — | {cells} | "
                      f"{np.mean(np.abs(list(p.values()))):.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
