"""kvsim's mean TTFT, mean TPOT and output throughput against public measured vLLM runs.

Every vLLM point of SemiAnalysis InferenceX that kvsim can read (``$KVSIM_SHARED_DATA``, default
``../shared/data``, ``inferencex/``: the measured latencies and, where the server log was
kept, the arguments each run passed), predicted from its own server and client settings with
the default cost model: the model (a shipped preset; the weights' precision from the scenario
name), the GPU preset, tensor parallel size, the passed engine arguments (else vLLM's
defaults), and InferenceX's client: the random dataset at the label's lengths, concurrency C
with 10·C prompts after 2·C warm-ups (``benchmarks/inferencex_runs.md``). Prints one row per
point (the measured throughput is derived by Little's law, ``measured_throughput``: the data
hold none) and the medians of |error| per GPU and model, per GPU, per model and in all. A
point kvsim cannot build (a model it has no config for, a layout it refuses) is listed as
such, with the reason, never dropped silently. Then every measured run of the shared data
(``llmservingsim/runs``), replayed as ``kvsim validate --against measured`` does, its TTFT
mean, median, P99 and TPOT mean errors beside the peer's.

    python benchmarks/timing_accuracy.py [--gpu h200] [--model gpt-oss-120b] [--jobs 2]

Not a timed test: the numbers are what the default cost model predicts today (README,
"How good the timing is").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvsim import measured  # noqa: E402
from kvsim.config import parse_scenario  # noqa: E402
from kvsim.engine import run  # noqa: E402
from kvsim.errors import ConfigError  # noqa: E402
from kvsim.metrics import summarize  # noqa: E402
from kvsim.semantics import VERSIONS  # noqa: E402
from kvsim.workload import build_requests  # noqa: E402

LENGTHS = {"1k1k": (1024, 1024), "1k8k": (1024, 8192), "8k1k": (8192, 1024)}
# InferenceX scenario names -> kvsim model presets and the weights' quantization method.
MODELS = {"gpt-oss-120b": ("gpt-oss-120b", {}),
          "llama-3.1-70b-instruct": ("llama-3.1-70b", {"fp8": "modelopt", "fp4": "modelopt_fp4"})}
HARDWARE = {"h100": "h100-sxm", "h200": "h200", "b200": "b200"}
ENGINE_KEYS = ("max_model_len", "max_num_batched_tokens", "max_num_seqs",
               "gpu_memory_utilization", "block_size", "enable_prefix_caching",
               "enable_expert_parallel")
RANGE_RATIO = 0.8  # InferenceX's --random-range-ratio (benchmarks/inferencex_runs.md)


def shared_data() -> Path:
    return Path(os.environ.get("KVSIM_SHARED_DATA", ROOT.parent / "shared" / "data"))


def release(version: str | None) -> str:
    """The covered vLLM release nearest below the run's (the oldest covered for older runs)."""
    covered = sorted(VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    if version is None:
        return covered[0]
    key = tuple(map(int, version.split(".")))
    below = [v for v in covered if tuple(map(int, v.split("."))) <= key]
    return below[-1] if below else covered[0]


def points(data: Path):
    """(sweep, concurrency, measured ttft s, tpot s, passed args, engine version) of every
    vLLM point."""
    absolutes = json.loads((data / "inferencex" / "inferencex_absolutes.json").read_text())
    settings = json.loads((data / "inferencex" / "inferencex_engine_settings.json").read_text())
    passed = {(s["scenario"], s["label"]): s["by_concurrency"] for s in settings["settings"]}
    for sw in absolutes["anchors"]:
        if sw["framework"] != "vllm":
            continue
        by_c = passed.get((sw["scenario"], sw["label"]), {})
        for c, ttft in sorted(sw["absolute_ttft_us"].items(), key=lambda kv: int(kv[0])):
            entry = by_c.get(c) or {}
            yield (sw, int(c), ttft / 1e6, sw["absolute_tpot_us"][c] / 1e6,
                   entry.get("passed", {}), (entry.get("resolved") or {}).get("engine_version"))


def scenario_for(sw: dict, conc: int, passed: dict, version: str | None,
                 prompts_per_conc: int) -> dict:
    """The kvsim scenario of one InferenceX point. Raises KeyError for an unread model."""
    m = re.fullmatch(r"(.+)-(b200|h100|h200|b300)-(fp4|fp8|bf16)-vllm-tp(\d+)(.*)\.yaml",
                     sw["scenario"])
    if m is None:
        raise KeyError(f"scenario name not understood: {sw['scenario']}")
    family, gpu, precision, tp, rest = m.groups()
    if family not in MODELS:
        raise KeyError(f"no kvsim model preset for {family} (issue #42: any config.json)")
    if rest:
        raise KeyError(f"parallelism {rest!r} (data/expert parallel) not predicted here yet")
    preset, quant = MODELS[family]
    isl, osl = LENGTHS[sw["label"]]
    model: dict = {"preset": preset}
    if precision in quant:
        model["quantization"] = quant[precision]
    engine = {"vllm_version": release(version), "tensor_parallel_size": int(tp),
              "enable_prefix_caching": False,
              "max_model_len": isl + osl + 256}
    engine.update({k: passed[k] for k in ENGINE_KEYS if k in passed})
    warmups = 2 * conc
    if family.startswith("llama"):
        # Oct 2025 runs, no server log: vLLM 0.10.2, FP8 KV, 8192-token steps, max_num_seqs
        # = C on Hopper (512 on B200), each script's max_model_len, no warm-ups
        # (inferencex_runs.md).
        short = sw["label"] == "1k1k"
        max_len = {"h100": 10240, "h200": 2068 if short else 9416,
                   "b200": (2048 if short else 9216) if precision == "fp8" else
                   (2068 if short else 9416)}[gpu]
        engine.update(kv_cache_dtype="fp8", max_num_batched_tokens=8192, max_model_len=max_len,
                      max_num_seqs=512 if gpu == "b200" else conc)
        warmups = 0
    elif gpu == "b200":
        engine["kv_cache_dtype"] = "fp8"  # gpt-oss on B200 (its launch script)
    return {"model": model, "hardware": {"preset": HARDWARE[gpu]}, "engine": engine,
            "workload": {"generator": "random", "num_requests": prompts_per_conc * conc,
                         "request_rate": math.inf, "random_input_len": isl,
                         "random_output_len": osl, "random_range_ratio": RANGE_RATIO,
                         "random_range_rule": "below", "max_concurrency": conc,
                         "num_warmups": warmups}}


def predict(raw: dict) -> dict:
    sc = parse_scenario(raw)
    s = summarize(sc, run(sc, build_requests(sc)))
    return {"ttft": s["ttft_s"]["mean"], "tpot": s["tpot_s"]["mean"],
            "tput": s["throughput"]["output_tokens_per_s"]}


def measured_throughput(workload: dict, conc: int, ttft: float, tpot: float) -> float:
    """Output tokens per second of a measured point, from its means by Little's law (the data
    hold no throughput): C requests in flight, each ``ttft + (out − 1)·tpot`` long, ``out``
    the mean drawn output length."""
    top = workload["random_output_len"]
    low = int(top * workload["random_range_ratio"])  # the "below" rule: [int(rL), L]
    out = (low + top) / 2
    return conc * out / (ttft + (out - 1) * tpot)


def _predict_or_error(raw: dict) -> dict | str:
    try:
        return predict(raw)
    except ConfigError as exc:
        return str(exc)


def predict_all(raws: list[dict], jobs: int = 1) -> list[dict | str]:
    """``predict`` of each scenario (the error's text where kvsim refuses it), in ``jobs``
    processes."""
    if jobs <= 1:
        return [_predict_or_error(r) for r in raws]
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_predict_or_error, raws, chunksize=1))


def err(pred: float, meas: float) -> float:
    return (pred - meas) / meas * 100




def print_measured_runs(data: Path) -> None:
    """Every measured run of the shared data (``llmservingsim/runs/<GPU>/<model>``), replayed as
    ``kvsim validate --against measured`` replays it (its defaults: the GPU's layer profiles),
    the error of each key metric beside the peer's."""
    folders = sorted(p.parents[1] for p in (data / "llmservingsim" / "runs").glob("*/*/vllm/meta.json"))
    if not folders:
        return
    print("\nmeasured runs (kvsim validate --against measured): error %, kvsim / peer")
    print(f"{'run':40}" + "".join(f"{m + ' ' + s:>18}" for m, s in measured.KEY_METRICS))
    for folder in folders:
        try:
            _, _, _, table = measured.compare(folder)
        except ConfigError as exc:
            print(f"{folder.parent.name + '/' + folder.name:40} not replayed: {exc}")
            continue
        got = {(t["metric"], t["stat"]): t for t in table}
        cells = []
        for key in measured.KEY_METRICS:
            t = got[key]
            peer = "" if t["peer_diff_pct"] is None else f"{t['peer_diff_pct']:+.1f}"
            cells.append(f"{t['diff_pct']:+7.1f} / {peer:>6}")
        print(f"{folder.parent.name + '/' + folder.name:40}" + "".join(f"{c:>18}" for c in cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", help="only this GPU (h100, h200, b200)")
    ap.add_argument("--model", help="only scenario names starting with this")
    ap.add_argument("--max-points", type=int, help="stop after N points")
    ap.add_argument("--prompts-per-concurrency", type=int, default=10,
                    help="requests per unit of concurrency (InferenceX: 10)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="processes (default: one per CPU)")
    args = ap.parse_args(argv)
    data = shared_data()
    if not (data / "inferencex").is_dir():
        print(f"no InferenceX data under {data} (set KVSIM_SHARED_DATA)")
        return 0
    rows, refused = [], {}
    start = time.perf_counter()
    todo = []
    for sw, c, ttft, tpot, passed, version in points(data):
        if args.gpu and sw["gpu"] != args.gpu or args.model and not sw["scenario"].startswith(
                args.model):
            continue
        if args.max_points and len(todo) >= args.max_points:
            break
        try:
            raw = scenario_for(sw, c, passed, version, args.prompts_per_concurrency)
        except KeyError as exc:
            refused.setdefault(str(exc).strip("'\""), []).append(f"{sw['scenario']} {sw['label']} c{c}")
            continue
        todo.append((sw, c, ttft, tpot, raw))
    print(f"{'scenario':44} {'label':5} {'C':>4} {'TTFT ms':>17} {'err':>7} {'TPOT ms':>13} "
          f"{'err':>7} {'output tok/s':>15} {'err':>7}")
    for (sw, c, ttft, tpot, raw), p in zip(todo, predict_all([t[-1] for t in todo], args.jobs)):
        if isinstance(p, str):
            refused.setdefault(p, []).append(f"{sw['scenario']} {sw['label']} c{c}")
            continue
        tput = measured_throughput(raw["workload"], c, ttft, tpot)
        e_ttft, e_tpot, e_tput = err(p["ttft"], ttft), err(p["tpot"], tpot), err(p["tput"], tput)
        family = sw["scenario"].split(f"-{sw['gpu']}-")[0]
        rows.append((sw["gpu"], family, e_ttft, e_tpot, e_tput))
        print(f"{sw['scenario'][:44]:44} {sw['label']:5} {c:>4} {p['ttft'] * 1e3:8.1f}/"
              f"{ttft * 1e3:<8.1f} {e_ttft:+7.1f} {p['tpot'] * 1e3:6.2f}/{tpot * 1e3:<6.2f} "
              f"{e_tpot:+7.1f} {p['tput']:7.0f}/{tput:<7.0f} {e_tput:+7.1f}", flush=True)
    print()
    groups: dict[str, list] = {}
    for r in rows:  # per GPU and model, per GPU, per model, all
        for name in (f"{r[0]} {r[1]}", r[0], r[1], "all"):
            groups.setdefault(name, []).append(r)
    kinds = ({f"{r[0]} {r[1]}" for r in rows}, {r[0] for r in rows}, {r[1] for r in rows}, {"all"})
    for name in [n for kind in kinds for n in sorted(kind)]:
        sel = groups[name]
        t, d, o = ([abs(r[i]) for r in sel] for i in (2, 3, 4))
        print(f"{name:28} {len(sel):4} points  median |err| TTFT {statistics.median(t):5.1f} % "
              f"(max {max(t):6.1f})  TPOT {statistics.median(d):5.1f} % (max {max(d):5.1f})  "
              f"throughput {statistics.median(o):5.1f} % (max {max(o):5.1f})")
    for why, which in refused.items():
        print(f"not predicted ({len(which)} points): {why}")
    if not args.gpu and not args.model and not args.max_points:
        print_measured_runs(data)
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
