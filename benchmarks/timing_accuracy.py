"""kvsim's mean TTFT and mean TPOT against public measured vLLM runs (throughput: not yet).

Every vLLM point of SemiAnalysis InferenceX that kvsim can read (``$KVSIM_SHARED_DATA``, default
``../shared/data``, ``inferencex/``: the measured latencies and, where the server log was
kept, the arguments each run passed), predicted from its own server and client settings with
the default cost model: the model (a shipped preset; the weights' precision from the scenario
name), the GPU preset, tensor parallel size, the passed engine arguments (else vLLM's
defaults), and InferenceX's client: the random dataset at the label's lengths, concurrency C
with 10·C prompts after 2·C warm-ups (``benchmarks/inferencex_runs.md``). Prints one row per
point and the medians of |error|, per GPU and in all. A point kvsim cannot build (a model it
has no config for, a layout it refuses) is listed as such, with the reason, never dropped
silently.

    python benchmarks/timing_accuracy.py [--gpu h200] [--model gpt-oss-120b] [--max-points N]

Not a timed test: the numbers are what the default cost model predicts today (README,
"Timing accuracy").
"""

from __future__ import annotations

import argparse
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
        # = C on Hopper (512 on B200), no warm-ups (inferencex_runs.md).
        engine.update(kv_cache_dtype="fp8", max_num_batched_tokens=8192,
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
    return {"ttft": s["ttft_s"]["mean"], "tpot": s["tpot_s"]["mean"]}


def err(pred: float, meas: float) -> float:
    return (pred - meas) / meas * 100


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", help="only this GPU (h100, h200, b200)")
    ap.add_argument("--model", help="only scenario names starting with this")
    ap.add_argument("--max-points", type=int, help="stop after N points")
    ap.add_argument("--prompts-per-concurrency", type=int, default=10,
                    help="requests per unit of concurrency (InferenceX: 10)")
    args = ap.parse_args(argv)
    data = shared_data()
    if not (data / "inferencex").is_dir():
        print(f"no InferenceX data under {data} (set KVSIM_SHARED_DATA)")
        return 0
    rows, refused = [], {}
    start = time.perf_counter()
    print(f"{'scenario':44} {'label':5} {'C':>4} {'TTFT ms':>17} {'err':>7} {'TPOT ms':>13} "
          f"{'err':>7}")
    for sw, c, ttft, tpot, passed, version in points(data):
        if args.gpu and sw["gpu"] != args.gpu or args.model and not sw["scenario"].startswith(
                args.model):
            continue
        if args.max_points and len(rows) >= args.max_points:
            break
        try:
            raw = scenario_for(sw, c, passed, version, args.prompts_per_concurrency)
            p = predict(raw)
        except (KeyError, ConfigError) as exc:
            refused.setdefault(str(exc).strip("'\""), []).append(f"{sw['scenario']} {sw['label']} c{c}")
            continue
        e_ttft, e_tpot = err(p["ttft"], ttft), err(p["tpot"], tpot)
        rows.append((sw["gpu"], sw["scenario"], e_ttft, e_tpot))
        print(f"{sw['scenario'][:44]:44} {sw['label']:5} {c:>4} {p['ttft'] * 1e3:8.1f}/"
              f"{ttft * 1e3:<8.1f} {e_ttft:+7.1f} {p['tpot'] * 1e3:6.2f}/{tpot * 1e3:<6.2f} "
              f"{e_tpot:+7.1f}", flush=True)
    print()
    for gpu in sorted({r[0] for r in rows}) + [None]:
        sel = [r for r in rows if gpu is None or r[0] == gpu]
        if not sel:
            continue
        t = [abs(r[2]) for r in sel]
        d = [abs(r[3]) for r in sel]
        print(f"{gpu or 'all':5} {len(sel):4} points  median |err| TTFT {statistics.median(t):6.1f} %"
              f" (max {max(t):7.1f})   TPOT {statistics.median(d):6.1f} % (max {max(d):6.1f})")
    for why, which in refused.items():
        print(f"not predicted ({len(which)} points): {why}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
