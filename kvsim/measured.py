"""``kvsim validate --against measured RUN_DIR``: replay a measured vLLM GPU run and compare.

A run folder (LLMServingSim's layout, ``../shared/data/llmservingsim/runs/<gpu>/<model>/``)
holds ``vllm/meta.json`` (the engine arguments), ``vllm/requests.jsonl`` (per request the
prompt and output lengths and vLLM's engine timestamps ``queued_ts``, ``first_token_ts``,
``last_token_ts``), ``config.json`` (the cluster: its ``hardware``) and, optionally,
``validation/summary.txt`` (a peer simulator's error table, shown beside kvsim's). The replayed
workload (``meta.json``'s ``dataset_path``, found in the run folder or a folder above it) gives
the prompts' token ids, so prefix-cache hits are real.

The replay: every request arrives at its ``queued_ts`` (vLLM's engine clock, relative to the
first), with its prompt ids and its measured output length; the engine runs the run's vLLM
release with its arguments and vLLM's defaults for the rest (block size 16, prefix caching on,
chunked prefill, ``gpu_memory_utilization`` 0.9), and the KV block count is derived from GPU
memory as vLLM's profiling would (``kvsim.config``'s estimate: memory × utilization − weights −
activation peak − non-torch memory, divided by the bytes of one block across layers). Step
times are interpolated in the same GPU's vLLM layer profiles at the run's tensor parallel size
(``kvsim.cost.interpolated``), found in the LLMServingSim tree the run sits in
(``profiles/<hardware>/<org>/<model>/<variant>``); without them, a shipped fitted profile for
that GPU (``rtxpro6000-*``); ``--profile`` names a fitted profile instead.

Metrics as vLLM's own benchmark (and the peer) count them, per request: TTFT = first token −
queued; TPOT = (last token − first token) / (output tokens − 1); latency = last token − queued.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim import engine, presets
from kvsim.config import parse_scenario
from kvsim.cost import fitted
from kvsim.errors import ConfigError
from kvsim.request import ExplicitTokens, RequestSpec
from kvsim.specdec import SPEC_METHODS
from kvsim.workload.jsonl import json_lines

METRICS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("Latency", "latency_ms"))
STATS = ("Mean", "Median", "P90", "P95", "P99")
# The figures a measured run is judged on (issue #38): TTFT mean, median, P99 and TPOT mean.
KEY_METRICS = (("TTFT", "Mean"), ("TTFT", "Median"), ("TTFT", "P99"), ("TPOT", "Mean"))
# vLLM's defaults where a run's meta.json leaves a setting out (as of vLLM 0.19).
VLLM_DEFAULTS = {"block_size": 16, "enable_prefix_caching": True, "gpu_memory_utilization": 0.9}
# vLLM's effective settings where the run recorded its resolved config (LLMServingSim's newer
# collector writes ``resolved_config``): (config section, vLLM's name, kvsim's [engine] key).
RESOLVED = (("cache_config", "block_size", "block_size"),
            ("cache_config", "enable_prefix_caching", "enable_prefix_caching"),
            ("cache_config", "gpu_memory_utilization", "gpu_memory_utilization"),
            ("cache_config", "kv_cache_memory_bytes", "kv_cache_memory_bytes"),
            ("scheduler_config", "max_num_seqs", "max_num_seqs"),
            ("scheduler_config", "max_num_batched_tokens", "max_num_batched_tokens"),
            ("scheduler_config", "enable_chunked_prefill", "enable_chunked_prefill"),
            ("scheduler_config", "long_prefill_token_threshold", "long_prefill_token_threshold"),
            ("scheduler_config", "async_scheduling", "async_scheduling"),
            ("scheduler_config", "policy", "scheduling_policy"),
            ("model_config", "max_model_len", "max_model_len"))


def resolved_engine(meta: dict) -> dict:
    """[engine] keys from the run's ``resolved_config`` (vLLM's effective settings), where it
    recorded them; a KV cache dtype other than ``auto`` too."""
    resolved = meta.get("resolved_config")
    if not isinstance(resolved, dict):
        return {}
    out = {}
    for section, name, key in RESOLVED:
        table = resolved.get(section)
        if isinstance(table, dict) and table.get(name) is not None:
            out[key] = table[name]
    cache = resolved.get("cache_config")
    if isinstance(cache, dict) and cache.get("cache_dtype") not in (None, "auto"):
        out["kv_cache_dtype"] = cache["cache_dtype"]
    return out


@dataclass
class MeasuredRun:
    folder: Path
    meta: dict
    hardware: dict  # [hardware]: a kvsim preset, or built from the run's own files
    model: str  # kvsim model preset, or a HF config.json's path
    specs: list[RequestSpec]
    measured: list[dict]  # per request: ttft_ms, tpot_ms, latency_ms (same order as specs)
    peer: dict[tuple[str, str], float] | None  # (metric, stat) -> the peer's value
    # the GPU link as the run's config.json describes its machine (link_bw GB/s, link_latency ns)
    link_bandwidth_bytes_per_s: float | None = None
    link_latency_s: float = 0.0
    num_gpu_blocks: int | None = None  # the KV blocks vLLM's profiling gave, if the run recorded it
    layer_profile: Path | None = None  # the same GPU's vLLM layer profiles, if found beside the run

    @property
    def hardware_name(self) -> str:
        return self.hardware.get("preset") or self.hardware["name"]


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file (expected a measured run folder with "
                          "vllm/meta.json, vllm/requests.jsonl and config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(str(path), f"not readable JSON: {exc}") from None


def _find_upward(folder: Path, rel: str) -> Path:
    for base in (folder, *folder.resolve().parents):
        if (base / rel).is_file():
            return base / rel
    raise ConfigError(str(folder / "vllm" / "meta.json"), f"dataset_path {rel!r} is not in the run "
                      "folder or any folder above it")


def _hardware_preset(name: str) -> str | None:
    for preset in presets.names("hardware"):
        data = presets.load("hardware", preset)
        assert data is not None  # a listed name
        if _norm(name) in (_norm(preset), _norm(data.get("device_name", ""))):
            return preset
    return None


def _first(table: dict, *keys: str):
    return next((table[k] for k in keys if table.get(k) not in (None, "")), None)


def _hardware(meta: dict, instance: dict, folder: Path) -> dict:
    """[hardware] of the run: the preset matching its GPU, else the GPU as the run's own files
    describe it: device name and total memory from vllm/meta.json (``device_name``,
    ``total_memory_bytes``; LLMServingSim's collectors may also nest them under ``hardware``
    or ``device``, as ``device_total_memory_bytes`` and ``device_capability`` too),
    else config.json's instance (``hardware``, ``npu_mem.mem_size`` GiB); memory bandwidth
    from ``npu_mem.mem_bw`` (GB/s). The step times come from the cost profile, so no FLOP/s
    figure is needed."""
    device: dict = next((meta[k] for k in ("hardware", "device") if isinstance(meta.get(k), dict)), {})
    name = str(_first(meta, "device_name", "gpu_name") or _first(device, "name", "device_name")
               or instance.get("hardware", ""))
    preset = _hardware_preset(name) or _hardware_preset(str(instance.get("hardware", "")))
    if preset is not None:
        return {"preset": preset}
    mem = instance.get("npu_mem") or {}
    memory = _first(meta, "total_memory_bytes", "gpu_memory_bytes") or _first(
        device, "device_total_memory_bytes", "total_memory_bytes", "total_memory")
    if memory is None and mem.get("mem_size"):
        memory = int(mem["mem_size"] * 2**30)
    if not name or memory is None or not mem.get("mem_bw"):
        raise ConfigError(str(folder / "config.json"), f"GPU {name!r} has no kvsim preset and the "
                          "run does not describe it (device name and total memory in "
                          "vllm/meta.json or nodes[0].instances[0].npu_mem.mem_size, and "
                          "npu_mem.mem_bw in config.json)")
    cc = _first(meta, "compute_capability") or _first(device, "compute_capability",
                                                      "device_capability")
    # Named as the run's own config.json names the machine (RTX4090 -> rtx4090), else by the GPU.
    label = _norm(str(instance.get("hardware", ""))) or _norm(name) or "gpu"
    table = {"name": label, "device_name": name, "memory_bytes": int(memory),
             "mem_bandwidth_bytes_per_s": float(mem["mem_bw"]) * 1e9}
    if cc:
        table["compute_capability"] = str(cc)
    return table


def _model_preset(hf_id: str, where: str) -> str:
    name = presets.by_hf_id(hf_id, ignore_instruct=True)
    if name is None:
        raise ConfigError(where, f"no kvsim model preset for {hf_id!r}")
    return name


def read_peer(path: Path) -> dict[tuple[str, str], float] | None:
    """``{(metric, stat): value}`` of the peer's column in ``validation/summary.txt``."""
    if not path.is_file():
        return None
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^(TTFT|TPOT|Latency) (Mean|Median|P90|P95|P99)\s+([-\d.]+)\s+([-\d.]+)", line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(4))
    return out or None


def load_run(folder: Path, model: str | None = None) -> MeasuredRun:
    """Read a measured run folder; ``model``: a kvsim model preset or a HF ``config.json`` for
    the run's model (default: the preset of meta.json's ``model``). Raises ConfigError naming
    the file and what is wrong."""
    meta = _read_json(folder / "vllm" / "meta.json")
    cluster = _read_json(folder / "config.json")
    try:
        if not isinstance(meta["engine_kwargs"], dict):
            raise TypeError
        hf_model = meta["model"]
        instance = cluster["nodes"][0]["instances"][0]
    except (KeyError, IndexError, TypeError):
        raise ConfigError(str(folder), "meta.json needs model and engine_kwargs, config.json "
                          "nodes[0].instances[0]") from None
    model = model or _model_preset(hf_model, str(folder / "vllm" / "meta.json"))
    hardware = _hardware(meta, instance, folder)
    caches = (meta.get("kv_cache"), meta.get("cache_config"),
              (meta.get("resolved_config") or {}).get("cache_config"))
    recorded = _first(meta, "num_gpu_blocks") or next(
        (c["num_gpu_blocks"] for c in caches if isinstance(c, dict) and c.get("num_gpu_blocks")),
        None)
    dataset = _find_upward(folder, str(meta.get("dataset_path", "")))
    lines = list(json_lines(dataset))
    rows = list(json_lines(folder / "vllm" / "requests.jsonl"))
    if len(rows) != len(lines):
        raise ConfigError(str(folder / "vllm" / "requests.jsonl"),
                          f"{len(rows)} requests, but the workload {dataset.name} has {len(lines)}")
    specs, measured = [], []
    try:
        q0 = min(r["queued_ts"] for _, r in rows)
        for (where, r), (wwhere, w) in zip(rows, lines):
            ids = w.get("input_tok_ids")
            n = r["output_toks"]
            if not ids or len(ids) != r["input_toks"] or w.get("output_toks") != n:
                raise ConfigError(where, f"request {r.get('request_id')!r} does not match its "
                                  f"workload line {wwhere} (prompt ids and lengths)")
            specs.append(RequestSpec(req_id=str(r["request_id"]), arrival_s=r["queued_ts"] - q0,
                                     prompt=ExplicitTokens(tuple(ids)), max_tokens=n))
            measured.append({
                "ttft_ms": 1e3 * (r["first_token_ts"] - r["queued_ts"]),
                "tpot_ms": 1e3 * (r["last_token_ts"] - r["first_token_ts"]) / (n - 1) if n > 1 else None,
                "latency_ms": 1e3 * (r["last_token_ts"] - r["queued_ts"])})
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(str(folder / "vllm" / "requests.jsonl"), f"a request lacks a usable "
                          f"field ({exc}); expected request_id, input_toks, output_toks, queued_ts, "
                          "first_token_ts, last_token_ts") from None
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_s)
    link_bw, link_latency = cluster.get("link_bw"), cluster.get("link_latency", 0)
    return MeasuredRun(folder, meta, hardware, model, [specs[i] for i in order],
                       [measured[i] for i in order], read_peer(folder / "validation" / "summary.txt"),
                       link_bw * 1e9 if link_bw else None, link_latency * 1e-9,
                       int(recorded) if recorded else None,
                       find_layer_profile(folder, str(instance.get("hardware", "")), hf_model,
                                          str(meta["engine_kwargs"].get("dtype", "auto"))))


# LLMServingSim's variant folder for a run's dtype.
VARIANTS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "auto": "bf16"}


def find_layer_profile(folder: Path, hardware: str, hf_model: str, dtype: str) -> Path | None:
    """The layer-profile folder of the run's GPU and model in the LLMServingSim tree the run
    sits in: ``profiles/<hardware>/<org>/<model>/<variant>`` (``profiler/perf/...`` in
    LLMServingSim's own repository) in the run folder or a folder above it."""
    if not hardware or not hf_model:
        return None
    variant = VARIANTS.get(dtype, dtype)
    for base in (folder, *folder.resolve().parents):
        for tree in (base / "profiles", base / "profiler" / "perf"):
            candidate = tree / hardware / hf_model / variant
            if (candidate / "meta.yaml").is_file():
                return candidate
    return None


def shipped_profile_for(model: str, hardware: str, tp: int) -> str:
    """The shipped profile measured for ``model`` at ``tp`` on ``hardware``'s GPU."""
    for name in fitted.shipped_profiles():
        p = fitted.load_profile(fitted.resolve_profile(name, None))
        if (p["model"].get("name") == model and p.get("tensor_parallel_size", 1) == tp
                and _norm(hardware) in _norm(p.get("device", ""))):
            return name
    raise ConfigError("--profile", f"no layer profiles of {hardware} beside the run (profiles/<"
                      f"hardware>/<org>/<model>/<variant> above it) and no shipped cost profile for "
                      f"{model} at tensor_parallel_size {tp} on {hardware}; give one with --profile")


def speculative_table(meta: dict) -> dict | None:
    """[speculative] of the run: vLLM's ``speculative_config`` (resolved, else as given), its
    method and ``num_speculative_tokens``; acceptance stays kvsim's default (a run does not
    record it). None without speculative decoding."""
    spec = ((meta.get("resolved_config") or {}).get("speculative_config")
            or meta["engine_kwargs"].get("speculative_config"))
    if not isinstance(spec, dict) or not spec.get("method"):
        return None
    method = str(spec["method"])
    method = "mtp" if method.endswith("mtp") else method  # deepseek_mtp, qwen3_next_mtp, ...
    if method not in SPEC_METHODS:
        raise ConfigError("vllm/meta.json: speculative_config.method", f"{spec['method']!r} is not "
                          f"modelled (kvsim has {', '.join(SPEC_METHODS[1:])})")
    return {"method": method, "num_speculative_tokens": int(spec.get("num_speculative_tokens") or 1)}


def cost_table(run: MeasuredRun, profile: str | None, tp: int) -> dict:
    """``[cost]`` of the replay: ``profile`` (fitted) if given, else the same GPU's layer
    profiles interpolated, else a shipped fitted profile for that GPU."""
    if profile:
        return {"profile": profile}
    if run.layer_profile is not None and (run.layer_profile / f"tp{tp}").is_dir():
        return {"layer_profile": str(run.layer_profile)}
    return {"profile": shipped_profile_for(run.model, run.hardware_name, tp)}


def scenario_table(run: MeasuredRun, profile: str | None) -> dict:
    """The kvsim scenario (as a TOML-like table) replaying ``run``."""
    kw = run.meta["engine_kwargs"]
    tp = int(kw.get("tensor_parallel_size", 1))
    engine_keys = {"vllm_version": run.meta["vllm_version"], "tensor_parallel_size": tp,
                   "max_num_seqs": kw["max_num_seqs"],
                   "max_num_batched_tokens": kw["max_num_batched_tokens"], **VLLM_DEFAULTS}
    if kw.get("max_model_len"):
        engine_keys["max_model_len"] = kw["max_model_len"]
    if int(kw.get("data_parallel_size", 1)) > 1:
        # The runs drive vLLM's AsyncLLM in one process: one DP load-balancing client.
        engine_keys.update(data_parallel_size=int(kw["data_parallel_size"]),
                           enable_expert_parallel=bool(kw.get("enable_expert_parallel", False)),
                           api_server_count=1)
    if kw.get("kv_cache_dtype", "auto") != "auto":
        engine_keys["kv_cache_dtype"] = kw["kv_cache_dtype"]
    engine_keys.update(resolved_engine(run.meta))
    if run.num_gpu_blocks:
        engine_keys["num_gpu_blocks"] = run.num_gpu_blocks
    hardware = dict(run.hardware)
    if run.link_bandwidth_bytes_per_s:
        hardware["interconnect_bandwidth_bytes_per_s"] = run.link_bandwidth_bytes_per_s
        hardware["interconnect_latency_s"] = run.link_latency_s
    model = ({"config": str(Path(run.model).resolve())} if run.model.endswith(".json")
             else {"preset": run.model})
    spec = speculative_table(run.meta)
    return {"model": model, "hardware": hardware,
            "engine": engine_keys, **({"speculative": spec} if spec else {}),
            "cost": cost_table(run, profile, tp),
            # the requests come from the run; this placeholder only satisfies the schema
            "workload": {"num_requests": 1}}


def _stats(values) -> dict[str, float]:
    a = np.asarray([v for v in values if v is not None], dtype=float)
    return {"Mean": float(a.mean()), "Median": float(np.median(a)),
            "P90": float(np.percentile(a, 90)), "P95": float(np.percentile(a, 95)),
            "P99": float(np.percentile(a, 99))}


def compare(folder: Path, profile: str | None = None, overrides: dict | None = None,
            model: str | None = None):
    """Replay the run with kvsim (``model``: as ``load_run``). Returns (scenario, records,
    per-request rows, table rows)."""
    run = load_run(folder, model)
    raw = scenario_table(run, profile)
    for section, keys in (overrides or {}).items():
        raw[section] = {**raw.get(section, {}), **keys}
    sc = parse_scenario(raw, folder / "vllm" / "meta.json")
    rec = engine.run(sc, run.specs)
    rows = []
    for r, m in zip(rec.requests, run.measured):
        if r.finish_s is None:
            raise ConfigError(str(folder), f"kvsim did not finish request {r.req_id} "
                              f"(stopped by {rec.stopped_by})")
        n = r.num_output_tokens
        assert r.first_token_s is not None and r.finish_s is not None  # finished
        rows.append({"req_id": r.req_id, "arrival_s": r.arrival_s,
                     "prompt_tokens": r.num_prompt_tokens, "output_tokens": n,
                     "kvsim_cached_tokens": r.cached_tokens,
                     "vllm_ttft_ms": m["ttft_ms"], "kvsim_ttft_ms": 1e3 * (r.first_token_s - r.arrival_s),
                     "vllm_tpot_ms": m["tpot_ms"],
                     "kvsim_tpot_ms": 1e3 * (r.finish_s - r.first_token_s) / (n - 1) if n > 1 else None,
                     "vllm_latency_ms": m["latency_ms"],
                     "kvsim_latency_ms": 1e3 * (r.finish_s - r.arrival_s)})
        if r.dp_rank is not None:  # the rank kvsim's DP balancer chose (the run does not say)
            rows[-1]["kvsim_dp_rank"] = r.dp_rank
    table = []
    for metric, key in METRICS:
        v = _stats(x[f"vllm_{key}"] for x in rows)
        k = _stats(x[f"kvsim_{key}"] for x in rows)
        for stat in STATS:
            peer = run.peer.get((metric, stat)) if run.peer else None
            table.append({"metric": metric, "stat": stat, "vllm": v[stat], "kvsim": k[stat],
                          "diff_pct": 100 * (k[stat] / v[stat] - 1), "peer": peer,
                          "peer_diff_pct": None if peer is None else 100 * (peer / v[stat] - 1)})
    return sc, rec, rows, table


def format_table(table: list[dict], peer_name: str = "peer") -> str:
    head = f"{'Metric':<16}{'vLLM':>11}{'kvsim':>11}{'Diff%':>9}{peer_name:>11}{'Diff%':>9}"
    lines = [head, "-" * len(head)]
    last = None
    for t in table:
        if last is not None and t["metric"] != last:
            lines.append("")
        last = t["metric"]
        peer = "" if t["peer"] is None else f"{t['peer']:>11.1f}{t['peer_diff_pct']:>+8.1f}%"
        lines.append(f"{t['metric'] + ' ' + t['stat']:<16}{t['vllm']:>11.1f}{t['kvsim']:>11.1f}"
                     f"{t['diff_pct']:>+8.1f}%{peer}")
    return "\n".join(lines)


ROW_COLUMNS = ("req_id", "arrival_s", "prompt_tokens", "output_tokens", "kvsim_cached_tokens",
               "vllm_ttft_ms", "kvsim_ttft_ms", "vllm_tpot_ms", "kvsim_tpot_ms", "vllm_latency_ms",
               "kvsim_latency_ms")


def rows_csv(rows: list[dict]) -> str:
    """Per request, measured beside predicted."""
    lines = [",".join(ROW_COLUMNS)]
    for r in rows:
        lines.append(",".join("" if r[c] is None else f"{r[c]:.6g}" if isinstance(r[c], float)
                              else str(r[c]) for c in ROW_COLUMNS))
    return "\n".join(lines) + "\n"


def summary_json(sc, table: list[dict]) -> str:
    e = sc.engine
    return json.dumps({"vllm_version": e.vllm_version, "model": sc.model.name,
                       "hardware": sc.hardware.name, "tensor_parallel_size": e.tensor_parallel_size,
                       "num_gpu_blocks": e.num_gpu_blocks, "block_size": e.block_size,
                       "cost_model": sc.cost.model,
                       "cost_profile": sc.cost.profile or sc.cost.layer_profile, "table": table},
                      indent=2) + "\n"


def plot(rows: list[dict], png: Path) -> None:
    """Predicted vs measured TTFT (scatter) and the TTFT and latency CDFs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    vt = np.array([r["vllm_ttft_ms"] for r in rows]) / 1e3
    kt = np.array([r["kvsim_ttft_ms"] for r in rows]) / 1e3
    ax = axes[0]
    ax.scatter(vt, kt, s=8)
    top = max(vt.max(), kt.max())
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set(xlabel="measured TTFT (s)", ylabel="kvsim TTFT (s)", title="TTFT per request")
    for ax, key, name in ((axes[1], "ttft_ms", "TTFT"), (axes[2], "latency_ms", "latency")):
        for who in ("vllm", "kvsim"):
            v = np.sort([r[f"{who}_{key}"] / 1e3 for r in rows])
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label="measured vLLM" if who == "vllm" else who)
        ax.set(xlabel=f"{name} (s)", ylabel="fraction of requests", title=f"{name} CDF")
        ax.legend()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def fit_step_overhead(folders: list[Path], profiles: dict[Path, str | None] | None = None,
                      rounds: int = 4) -> tuple[float, list[dict]]:
    """The per-step overhead, seconds, that makes the replays' decode steps as long as the runs'
    (pooled mean TPOT over every request of ``folders``, runs of one GPU), each replayed as
    ``compare`` does (``profiles``: a fitted profile per run instead). A decode step holds the
    overhead once, so each round moves it by the mean TPOT miss (never below 0); a few rounds
    settle the queueing it changes. Returns the overhead and, per run, the TPOT means (ms)
    measured and replayed with the overhead before the last round's move."""
    overhead = 0.0
    per_run: list[dict] = []
    for _ in range(rounds):
        misses, per_run = [], []
        for folder in folders:
            profile = (profiles or {}).get(folder)
            _, _, rows, _ = compare(folder, profile, {"cost": {"step_overhead_s": overhead}})
            pairs = [(r["vllm_tpot_ms"], r["kvsim_tpot_ms"]) for r in rows
                     if r["vllm_tpot_ms"] is not None and r["kvsim_tpot_ms"] is not None]
            misses += [m - k for m, k in pairs]
            per_run.append({"run": str(folder), "vllm_tpot_ms": float(np.mean([m for m, _ in pairs])),
                            "kvsim_tpot_ms": float(np.mean([k for _, k in pairs]))})
        step = 1e-3 * float(np.mean(misses))
        if abs(step) < 1e-5:
            break
        overhead = max(0.0, overhead + step)
    return overhead, per_run
