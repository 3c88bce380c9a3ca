"""The two step-time models where vLLM layer profiles exist, side by side in one run.

1. Held-out profile rows: for every profile folder (and tensor parallel size), a seeded fifth
   of ``attention.csv``'s grid points is left out; the interpolated model is built from the
   rest and the fitted form fitted to the rest's composed rows; both predict the left-out
   points' composed target passes (the measured attention with the same dense layers), and
   the table gives |predicted / measured - 1|.
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
from kvsim.config import model_preset
from kvsim.cost.fitted import features, pass_time_s
from kvsim.cost.interpolated import LayerProfile, composed_rows, read_meta, tp_degrees
from kvsim.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVSIM_SHARED_DATA", ROOT.parent / "shared" / "data"))
KEY_METRICS = (("TTFT", "Mean"), ("TTFT", "Median"), ("TTFT", "P99"), ("TPOT", "Mean"))


# (profiles, runs) folders of the two layouts
LAYOUTS = (("profiles", "runs"), ("profiler/perf", "bench/examples"))


def trees(extra: list[str]) -> list[Path]:
    roots = [SHARED / "llmservingsim", *map(Path, extra)]
    return [r for r in roots if any((r / a).is_dir() or (r / b).is_dir() for a, b in LAYOUTS)]


def profile_folders(root: Path) -> list[tuple[Path, Path]]:
    """(folder, the profiles folder it is under)."""
    return sorted((p.parent, root / a) for a, _ in LAYOUTS for p in (root / a).glob("*/*/*/*/meta.yaml"))


def heldout(folder: Path, tp: int, seed: int = 0) -> dict[str, tuple[float, float, float]] | None:
    name = llmservingsim.preset_for(read_meta(folder).get("model", ""))
    if name is None:
        return None
    model = model_preset(name)
    full = LayerProfile(folder, tp, model)
    inside = [i for i, (pc, _, nd, _, _) in enumerate(full.points) if 0 < pc + nd <= full.max_tokens]
    rng = np.random.default_rng(seed)
    held = set(rng.choice(inside, len(inside) // 5, replace=False).tolist())
    train = LayerProfile(folder, tp, model, keep=[i for i in range(len(full.points)) if i not in held])
    rows = [r for r in composed_rows(train, {}) if r["pass"] == "target"]
    params = fit.fit_rows(rows, str(folder), seed, full.experts)["target"][0]
    layers = model.num_hidden_layers
    err: dict[str, list[float]] = {"interpolated": [], "fitted": []}
    for i in sorted(held):
        pc, kp, nd, kd, _ = full.points[i]
        step = full.grid_step(pc, kp, nd, kd)
        truth = full.pass_us(step, layers) * 1e-6
        err["interpolated"].append(train.pass_us(step, layers) * 1e-6 / truth - 1)
        decodes = (step.num_decodes, step.decode_kv, step.longest, step.shortest) if nd else None
        feats = features(step.prefills, int(step.rows), 1, full.experts, decodes)
        err["fitted"].append(pass_time_s(params, feats) / truth - 1)
    return {k: (float(np.median(np.abs(v))) * 100, float(np.percentile(np.abs(v), 90)) * 100,
                float(np.max(np.abs(v))) * 100) for k, v in err.items()} | {"n": len(held)}


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
    print("## Held-out profile rows (a seeded fifth of attention.csv's grid, composed target passes)\n")
    print("| profile | tp | held-out rows | interpolated median / p90 / max | fitted median / p90 / max |")
    print("|---|---|---|---|---|")
    seen = set()  # a GPU's data in two trees counts once (the first)
    for root in roots:
        for folder, under in profile_folders(root):
            if folder.relative_to(under) in seen:
                continue
            seen.add(folder.relative_to(under))
            for tp in tp_degrees(folder):
                try:
                    res = heldout(folder, tp)
                except ConfigError as exc:  # e.g. an MoE model's tp without moe.csv
                    print(f"| {folder.relative_to(under)} | {tp} | — | not composed: "
                          f"{Path(exc.where).name}: {exc.what} | |")
                    continue
                if res is None:
                    continue
                i, f = res["interpolated"], res["fitted"]
                print(f"| {folder.relative_to(under)} | {tp} | {res['n']} | "
                      f"{i[0]:.1f} / {i[1]:.1f} / {i[2]:.0f} % | {f[0]:.1f} / {f[1]:.1f} / {f[2]:.0f} % |",
                      flush=True)
    runs = list({(r.parent.name, r.name): r for root in reversed(roots) for r in runs_of(root)}.values())
    by_gpu: dict[str, list[Path]] = {}
    for run in runs:
        by_gpu.setdefault(run.parent.name, []).append(run)
    with tempfile.TemporaryDirectory() as tmp:
        fitted = {run: fitted_profile(run, Path(tmp)) for run in runs}
        interp = dict.fromkeys(runs)
        print("\n## Measured runs: error of TTFT mean / median / P99 / TPOT mean (%), and the mean "
              "|error| over all 15 metrics\n")
        print("| run | model | step overhead | TTFT mean | TTFT median | TTFT P99 | TPOT mean | "
              "mean abs, 15 metrics |")
        print("|---|---|---|---|---|---|---|---|")
        for run in runs:
            others = [r for r in by_gpu[run.parent.name] if r != run]
            name = f"{run.parent.name}/{run.name}"
            for label, profiles in (("interpolated", interp), ("fitted", fitted)):
                cases = [("default", None)]
                if others:
                    overhead, _ = measured.fit_step_overhead(others, profiles)
                    cases.append(("fitted on the GPU's other runs", overhead))
                for how, overhead in cases:
                    e = errors(run, profiles[run], overhead)
                    k = e["kvsim"]
                    cells = " | ".join(f"{k[m]:+.1f}" for m in KEY_METRICS)
                    print(f"| {name} | {label} | {e['overhead_ms']:.2f} ms ({how}) | {cells} | "
                          f"{np.mean(np.abs(list(k.values()))):.1f} |", flush=True)
            p = e["peer"]
            if all(v is not None for v in p.values()):
                cells = " | ".join(f"{p[m]:+.1f}" for m in KEY_METRICS)
                print(f"| {name} | peer (LLMServingSim) | — | {cells} | "
                      f"{np.mean(np.abs(list(p.values()))):.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
