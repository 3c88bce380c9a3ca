"""Scenario files: the only module that reads TOML.

A scenario has the sections ``[model]``, ``[hardware]``, ``[engine]``, ``[speculative]``,
``[workload]``, ``[cost]``, ``[run]`` and, for several replicas behind a router,
``[cluster]``. Every key is declared once in ``kvsim.schema``, with its type, default and
meaning; this module checks a file against it and fills in what is derived: the model from a
preset or config.json (``kvsim.hf``), its KV layout (``kvsim.layout``) and the engine keys
left out, from vLLM's defaults for the chosen ``vllm_version`` (``kvsim.semantics``). Bad input
raises ``ConfigError`` naming the key.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import tomllib
from dataclasses import fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from kvsim import hf, presets, traces
from kvsim.errors import ConfigError
from kvsim.kv.hybrid import GroupSpec
from kvsim.kv.nixl import check_pd
from kvsim.kv.offload import OffloadParams, check_offload, num_cpu_chunks
from kvsim.layout import KVLayout, derive_layout, estimate_kv_cache_bytes, mamba_cache_mode
from kvsim.model import GiB, ModelCfg, attention_page_bytes_per_token
from kvsim.sched import reserved_token_budget
from kvsim.schema import (
    DEPLOYMENT_REPLICAS,
    ENGINE_KEYS,
    GROUP_KEYS,
    KV_TRANSFER_LINKS,
    MAX_GPU_BLOCKS,
    MAX_REPLICAS,
    MODEL_KEYS,
    OFFLOAD_EXTRA_KEYS,
    OFFLOAD_ONLY_EXTRA,
    PD_ONLY_EXTRA,
    REQUIRED,
    RETENTION,
    SCHEMA,
    SHARED_ENGINE_KEYS,
    VLLM_NAMES,
    ClusterCfg,
    CostCfg,
    EngineCfg,
    HardwareCfg,
    Key,
    RunCfg,
    Scenario,
    SpecCfg,
    WorkloadCfg,
)
from kvsim.semantics import VERSIONS, Semantics, semantics_for
from kvsim.specdec import EAGLE_METHODS, derive_spec, num_prefill_lookahead


def _suggest(name: str, known: list[str]) -> str:
    """' (did you mean ...?)' for the known name ``name`` most likely meant: the same but for
    case, the one it begins or is the beginning of (``h100`` -> ``h100-sxm``), else the
    closest spelling; '' when none is close."""
    lower = {k.lower(): k for k in known}
    n = name.lower()
    if n in lower:
        return f" (did you mean '{lower[n]}'?)"
    stems = [k for low, k in lower.items() if len(n) >= 3 and (low.startswith(n) or n.startswith(low))]
    close = stems if len(stems) == 1 else difflib.get_close_matches(n, list(lower), n=1)
    if close:
        return f" (did you mean '{lower.get(close[0], close[0])}'?)"
    return ""


def _unknown_key(where: str, section: str, name: str, keys) -> ConfigError:
    """The error for a key ``section`` has no such name: vLLM's own name for something kvsim
    takes elsewhere (or does not model) is said so, rather than a look-alike key."""
    said = VLLM_NAMES.get((section, name))
    if said is not None:
        return ConfigError(where, f"not a kvsim key: {said}")
    return ConfigError(where, f"unknown key{_suggest(name, list(keys))}")


def _tables(where: str, value: Any, section: str) -> list[dict]:
    """A non-empty TOML array of tables (``[[section]]``), or ConfigError."""
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        raise ConfigError(where, f"must be a list of tables ([[{section}]])")
    return value


def _check_groups(where: str, value: Any) -> tuple:
    value = _tables(where, value, "engine.kv_groups")
    keys = {k.name: k for k in GROUP_KEYS}
    out = []
    for i, table in enumerate(value):
        w = f"{where}[{i}]"
        for name in table:
            if name not in keys:
                raise ConfigError(f"{w}.{name}", f"unknown key{_suggest(name, list(keys))}")
        g = {}
        for k in GROUP_KEYS:
            if k.name in table:
                g[k.name] = _check_value(f"{w}.{k.name}", k, table[k.name])
            elif k.default is REQUIRED:
                raise ConfigError(f"{w}.{k.name}", "missing")
            else:
                g[k.name] = k.default
        if (g["kind"] == "sliding_window") != (g["sliding_window"] is not None):
            raise ConfigError(f"{w}.sliding_window", "required for a sliding_window group"
                              if g["kind"] == "sliding_window" else "only for sliding_window groups")
        if g["prefill_checkpoint_alignment"] is not None and g["kind"] != "mamba":
            raise ConfigError(f"{w}.prefill_checkpoint_alignment", "only for mamba groups")
        out.append(GroupSpec(kind=g["kind"], block_size=g["block_size"],
                             sliding_window=g["sliding_window"] or 0, eagle=g["eagle"],
                             num_layers=g["num_layers"],
                             prefill_checkpoint_alignment=g["prefill_checkpoint_alignment"]))
    mamba = [i for i, g in enumerate(out) if g.kind == "mamba"]
    if len({out[i].prefill_checkpoint_alignment for i in mamba}) > 1:
        raise ConfigError(f"{where}[{mamba[1]}].prefill_checkpoint_alignment", "every mamba group "
                          "must have the same (vLLM's Mamba layers share one checkpoint grid)")
    if mamba and len({g.block_size for g in out}) > 1:
        raise ConfigError(f"{where}[{mamba[0]}].block_size", "with a mamba group every group must "
                          "use the mamba block_size (vLLM's layout for Mamba models; sub-block "
                          "Mamba hits are not modelled)")
    return tuple(out)


def _check_table(where: str, value: Any, keys: tuple[Key, ...]) -> dict[str, Any]:
    """An inline table of ``keys`` (those given, checked; the reader applies defaults)."""
    if not isinstance(value, dict):
        raise ConfigError(where, "must be a table, e.g. {blocks_per_chunk = 4}")
    known = {k.name: k for k in keys}
    out = {}
    for name, v in value.items():
        if name not in known:
            raise ConfigError(f"{where}.{name}", f"unknown key{_suggest(name, list(known))}")
        out[name] = _check_value(f"{where}.{name}", known[name], v)
    return out


def _check_deployments(where: str, value: Any) -> tuple:
    """``[[cluster.deployment]]`` tables: ``replicas`` plus [engine] keys to override."""
    value = _tables(where, value, "cluster.deployment")
    engine_keys = {k.name: k for k in ENGINE_KEYS}
    out = []
    for i, table in enumerate(value):
        w = f"{where}[{i}]"
        overrides = []
        for name, v in table.items():
            if name == "replicas":
                continue
            if name in SHARED_ENGINE_KEYS:
                raise ConfigError(f"{w}.{name}", f"every replica shares {', '.join(SHARED_ENGINE_KEYS)}"
                                  " (a router compares block hashes across replicas); set it in "
                                  "[engine]")
            if name not in engine_keys:
                raise ConfigError(f"{w}.{name}", "unknown key (a deployment takes replicas and "
                                  f"[engine] keys){_suggest(name, ['replicas', *engine_keys])}")
            overrides.append((name, _check_value(f"{w}.{name}", engine_keys[name], v)))
        n = _check_value(f"{w}.replicas", DEPLOYMENT_REPLICAS, table.get("replicas", 1))
        out.append((n, tuple(overrides)))
    return tuple(out)


def _num(bound: float) -> str:
    """A bound as a reader wants it: 4,194,304, not 4.1943e+06; 0.5 as 0.5."""
    return f"{int(bound):,}" if float(bound).is_integer() else f"{bound:g}"


def _check_value(where: str, key: Key, value: Any) -> Any:
    t = key.type
    if t == "groups":
        return _check_groups(where, value)
    if t == "deployments":
        return _check_deployments(where, value)
    if t == "table":
        return _check_table(where, value, OFFLOAD_EXTRA_KEYS)
    if t == "floats":
        if (not isinstance(value, list) or not value
                or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in value)):
            raise ConfigError(where, f"must be a non-empty list of numbers, got {value!r}")
        value = [float(x) for x in value]
        if any(not (key.low or 0) <= x <= (key.high if key.high is not None else math.inf)
               or math.isnan(x) for x in value):
            raise ConfigError(where, f"entries must lie in [{key.low:g}, {key.high:g}], got {value!r}")
        return tuple(value)
    if t == RETENTION:
        if value == "dense":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(where, f'must be an integer >= 0 or "dense", got {value!r}')
        return value
    if t == "bool":
        if not isinstance(value, bool):
            raise ConfigError(where, f"must be true or false, got {value!r}")
        return value
    if t == "str":
        if not isinstance(value, str):
            raise ConfigError(where, f"must be a string, got {value!r}")
        if key.choices and value not in key.choices:
            raise ConfigError(where, f"must be one of {', '.join(map(repr, key.choices))}, "
                              f"got {value!r}{_suggest(value, list(key.choices))}")
        return value
    if t == "int":
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**62:
            value = int(value)  # 1e9 style
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(where, f"must be an integer, got {value!r}")
    elif t == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(where, f"must be a number, got {value!r}")
        value = float(value)
        if math.isnan(value):
            raise ConfigError(where, "must be a number, got nan")
    if key.low is not None and (value < key.low or (key.low_open and value == key.low)):
        bound = f"greater than {_num(key.low)}" if key.low_open else f"at least {_num(key.low)}"
        raise ConfigError(where, f"must be {bound}, got {value!r}")
    if key.high is not None and value > key.high:
        raise ConfigError(where, f"must be at most {_num(key.high)}, got {value!r}")
    return value


def _section(raw: dict, section: str, file: str) -> dict[str, Any]:
    """Validate one section: unknown keys, types, ranges, presets. Returns key -> value."""
    table = raw.get(section, {})  # a table: parse_scenario checked
    keys = {k.name: k for k in SCHEMA[section]}
    for name in table:
        if name not in keys:
            raise _unknown_key(f"{file}: {section}.{name}", section, name, keys)
    merged: dict[str, Any] = {}
    preset_name = table.get("preset")
    if preset_name is not None:
        _check_value(f"{file}: {section}.preset", keys["preset"], preset_name)
        kind = "models" if section == "model" else "hardware"
        data = presets.load(kind, preset_name)
        if data is None:
            known = presets.names(kind)
            raise ConfigError(f"{file}: {section}.preset",
                              f"unknown preset {preset_name!r}{_suggest(preset_name, known)}; "
                              f"known: {', '.join(known)}")
        merged.update({k: v for k, v in data.items() if k in keys})
    merged.update(table)
    out = {}
    for key in SCHEMA[section]:
        where = f"{file}: {section}.{key.name}"
        if key.name in merged:
            out[key.name] = _check_value(where, key, merged[key.name])
        elif key.default is REQUIRED:
            hint = " (or name a preset with 'preset = ...')" if "preset" in keys else ""
            raise ConfigError(where, f"missing{hint}")
        else:
            out[key.name] = key.default
    return out


def _build(cls, values: dict[str, Any]):
    return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


def model_preset(name: str, where: str = "--model") -> ModelCfg:
    """The model of shipped preset ``name`` (or its Hugging Face id). Raises ConfigError
    naming ``where``."""
    data = presets.load("models", name)
    if data is None:
        known = presets.names("models")
        raise ConfigError(where, f"unknown model preset {name!r}{_suggest(name, known)}; "
                          f"known: {', '.join(known)}")
    return hf.model_from_config(data["config"], f"kvsim/presets/models/{data['name']}.json",
                                name=data["name"], hf_id=data.get("hf_id", ""),
                                preset=data["name"])


def model_from_path(path: str | Path) -> ModelCfg:
    """The model of a config.json (or a folder holding one). Raises ConfigError."""
    data, p = hf.read_config_file(path)
    return hf.model_from_config(data, str(p), name=p.parent.name, config=str(p.resolve()))


def _model(raw: dict, file: str, base: Path | None) -> ModelCfg:
    """[model]: a preset or a config.json, with keys overriding it, or every key by hand."""
    table = raw.get("model", {})
    where = f"{file}: model"
    if "preset" in table and "config" in table:
        raise ConfigError(f"{where}.config", "give preset or config, not both")
    if "preset" not in table and "config" not in table:
        return _build(ModelCfg, _section(raw, "model", file))
    keys = {k.name: k for k in MODEL_KEYS}
    for name in table:
        if name not in keys:
            raise _unknown_key(f"{where}.{name}", "model", name, keys)
    if "preset" in table:
        name = _check_value(f"{where}.preset", keys["preset"], table["preset"])
        model = model_preset(name, f"{where}.preset")
    else:
        path = Path(_check_value(f"{where}.config", keys["config"], table["config"])).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        model = model_from_path(path)
    overrides = {k: _check_value(f"{where}.{k}", keys[k], v) for k, v in table.items()
                 if k not in ("preset", "config")}
    n = overrides.get("num_hidden_layers")
    if n is not None and model.layer_types and n != len(model.layer_types):
        raise ConfigError(f"{where}.num_hidden_layers", f"{n} differs from the {len(model.layer_types)} "
                          f"layer kinds of {model.preset or model.config}")
    return replace(model, **overrides)


def _engine(raw: dict, file: str, model: ModelCfg, hw: HardwareCfg) -> EngineCfg:
    e = _section(raw, "engine", file)
    where = f"{file}: engine"
    sem = semantics_for(e["vllm_version"])
    assert sem is not None  # a choice of the key
    method = (raw.get("speculative") or {}).get("method", "none")
    ngram = method == "ngram"
    if e["async_scheduling"] is None:
        e["async_scheduling"] = sem.default_async_scheduling(method)
    elif e["async_scheduling"] and ngram and not sem.async_allows_ngram:
        raise ConfigError(f"{where}.async_scheduling", f"vLLM {sem.version} refuses ngram "
                          "drafting with asynchronous scheduling")
    elif e["async_scheduling"] and not sem.async_modelled:
        raise ConfigError(f"{where}.async_scheduling",
                          f"vLLM {sem.version}'s asynchronous scheduler is not modelled yet "
                          f"(modelled: {', '.join(v for v, s in VERSIONS.items() if s.async_modelled)}); "
                          "set it to false")
    if e["enable_prefix_caching"] is None:
        hybrid = (any(g.kind == "mamba" for g in e["kv_groups"]) if e["kv_groups"] is not None
                  else "linear_attention" in model.layers)
        e["enable_prefix_caching"] = sem.default_prefix_caching(hybrid)
    batch_defaults = sem.serve_batch_defaults(hw.memory_bytes, hw.name + " " + hw.device_name,
                                              hw.capability)
    for key, default in zip(("max_num_batched_tokens", "max_num_seqs"), batch_defaults):
        if e[key] is None:
            e[key] = default
    if e["max_model_len"] is None:
        e["max_model_len"] = model.max_position_embeddings
    if e["gpu_memory_utilization"] is None:
        e["gpu_memory_utilization"] = sem.default_gpu_memory_utilization
    tp = e["tensor_parallel_size"]
    if model.num_attention_heads % tp:
        raise ConfigError(f"{where}.tensor_parallel_size",
                          f"{tp} does not divide num_attention_heads ({model.num_attention_heads})")
    if tp > 1 and hw.interconnect_bandwidth_bytes_per_s is None:
        raise ConfigError(f"{file}: hardware.interconnect_bandwidth_bytes_per_s",
                          f"needed for tensor_parallel_size {tp} (each layer's all-reduces)")
    dp = e["data_parallel_size"]
    if dp > 1 and model.num_experts and hw.interconnect_bandwidth_bytes_per_s is None:
        raise ConfigError(f"{file}: hardware.interconnect_bandwidth_bytes_per_s",
                          f"needed for data_parallel_size {dp} with an MoE model (each MoE layer "
                          "gathers and scatters the ranks' tokens)")
    if e["enable_expert_parallel"] and not model.num_experts:
        raise ConfigError(f"{where}.enable_expert_parallel", f"{model.name} has no experts (a dense "
                          "model)")
    if e["api_server_count"] is None:
        e["api_server_count"] = dp  # vllm serve's default with the internal DP load balancer
    # vLLM's own start-up checks (SchedulerConfig.verify_max_model_len).
    mnbt, mml = e["max_num_batched_tokens"], e["max_model_len"]
    if not e["enable_chunked_prefill"] and mnbt < mml:
        raise ConfigError(f"{where}.max_num_batched_tokens",
                          f"{mnbt} is smaller than max_model_len ({mml}) with chunked prefill off; "
                          "vLLM refuses this")
    if mnbt < e["max_num_seqs"]:
        raise ConfigError(f"{where}.max_num_batched_tokens",
                          f"{mnbt} must be at least max_num_seqs ({e['max_num_seqs']})")
    if e["long_prefill_token_threshold"] > mml:
        raise ConfigError(f"{where}.long_prefill_token_threshold",
                          f"{e['long_prefill_token_threshold']} exceeds max_model_len ({mml})")
    # Speculative tokens, for Mamba's state blocks and a window's re-prefillable tail (k is
    # checked with [speculative] below).
    k = _num_speculative_tokens(raw.get("speculative") or {}, model)
    nsb = k if method != "none" and isinstance(k, int) and not isinstance(k, bool) and k > 0 else 0
    if e["mamba_cache_mode"] == "all" and "all" not in sem.layout.mamba_cache_modes:
        raise ConfigError(f"{where}.mamba_cache_mode", f"vLLM {sem.version} has no mode 'all' "
                          f"(it has {', '.join(map(repr, sem.layout.mamba_cache_modes))})")
    if e["kv_groups"] is None:
        layout = _layout(model, hw, e, sem, nsb, f"{file}: ")
        e["kv_groups"], e["block_size"] = layout.groups, layout.block_size
        e["mamba_cache_mode"] = layout.mamba_cache_mode
        block_bytes = layout.block_bytes
    else:
        # Groups by hand: vLLM's hybrid allocator gives every group the same number of layers,
        # and one block id spans one page in each of those layers: a group's worth of layers.
        groups = e["kv_groups"]
        per_layer = attention_page_bytes_per_token(model, e["kv_cache_dtype"], tp)
        layers = max((g.num_layers or 0 for g in groups), default=0) or -(-model.num_hidden_layers
                                                                         // len(groups))
        block_bytes = int(per_layer * max(g.block_size for g in groups) * layers)
        e["block_size"] = math.lcm(*(g.block_size for g in groups))
        e["mamba_cache_mode"] = mamba_cache_mode(sem.layout, e["mamba_cache_mode"],
                                                 e["enable_prefix_caching"]) if any(
            g.kind == "mamba" for g in groups) else "none"
    groups = e["kv_groups"]
    mamba = [g for g in groups or () if g.kind == "mamba"]
    if mamba and e["enable_prefix_caching"] and sem.hybrid.mamba_split in (
            "last_block", "last_block_junction", "last_block_stops"):
        # 0.19-0.26 round every prefill chunk down to the block: a block larger than a chunk
        # can ever be means no prompt longer than one block is ever scheduled (vLLM stalls;
        # 0.26 asserts, config/vllm.py:2264-2273). 0.27+ advance by less than a block.
        b, limit = mamba[0].block_size, mnbt
        if e["long_prefill_token_threshold"] > 0:
            limit = min(limit, e["long_prefill_token_threshold"])
        if b > limit:
            raise ConfigError(f"{where}.kv_groups", f"the mamba block_size ({b}) exceeds the "
                              f"largest prefill chunk ({limit}): vLLM {sem.version}'s aligned "
                              "split can never schedule a longer prompt (the engine stalls)")
    derived = e["num_gpu_blocks"] is None
    if derived and model.index_head_dim and e["kv_cache_dtype"].startswith("fp8"):
        # vLLM pages an fp8 sparse-MLA cache by GPU: fp8_ds_mla (656 B a token) on Hopper,
        # plain fp8 (576 B) on Blackwell; only the 16-bit page is modelled.
        raise ConfigError(f"{where}.kv_cache_dtype", f"{e['kv_cache_dtype']!r} with DeepSeek "
                          "Sparse Attention (an fp8_ds_mla page on Hopper) is not modelled: "
                          "leave it 'auto', or set engine.num_gpu_blocks")
    if derived:
        if e["kv_cache_memory_bytes"] is not None:
            avail = e["kv_cache_memory_bytes"]
        else:
            avail, parts = estimate_kv_cache_bytes(model, hw.memory_bytes, e["gpu_memory_utilization"], tp,
                                                   mnbt, e["max_num_seqs"], dp)
            if avail <= 0:
                raise ConfigError(f"{where}.num_gpu_blocks",
                                  f"no memory left for the KV cache: {hw.memory_bytes / GiB:.1f} GiB × "
                                  f"{e['gpu_memory_utilization']} minus weights "
                                  f"{parts['weights_bytes'] / GiB:.1f} GiB and activations leaves "
                                  f"{avail / GiB:.1f} GiB; raise tensor_parallel_size or "
                                  "gpu_memory_utilization, or set num_gpu_blocks")
        e["num_gpu_blocks"] = int(avail // block_bytes)
        if e["num_gpu_blocks"] > MAX_GPU_BLOCKS:
            raise ConfigError(f"{where}.num_gpu_blocks", f"{avail / GiB:.1f} GiB of KV cache makes "
                              f"{e['num_gpu_blocks']:,} blocks of {block_bytes:,} bytes, more than "
                              f"kvsim holds ({MAX_GPU_BLOCKS:,}); set num_gpu_blocks")
    usable = e["num_gpu_blocks"] - 1
    if groups:
        # vLLM's max_in_flight_tokens (0.32+), or max_num_batched_tokens before.
        in_flight = mnbt * (2 if e["async_scheduling"] and sem.has_max_in_flight_tokens else 1)
        extra = max(0, num_prefill_lookahead(method, nsb, model.num_nextn_predict_layers, sem) - 1)
        needed = sum(g.max_blocks_per_request(mml, in_flight, num_speculative_blocks=nsb,
                                              mamba_align=e["enable_prefix_caching"],
                                              extra_retained_tokens=extra) for g in groups)
    else:
        needed = -(-mml // e["block_size"])
    if needed > usable:
        raise ConfigError(f"{where}.max_model_len",
                          f"one request of max_model_len {mml} needs {needed} blocks but the pool has "
                          f"{usable} usable (num_gpu_blocks {e['num_gpu_blocks']} minus the null "
                          "block); vLLM refuses to start: lower max_model_len or enlarge the pool")
    e["num_gpu_blocks_derived"] = derived
    e["kv_block_bytes"] = block_bytes
    _check_kv_role(e, where, sem)
    e["offload"] = _offload(e, where, file, sem, method, hw, block_bytes)
    check_groups_for_release(f"{where}.kv_groups", groups, sem)
    e["prefix_cache_retention_interval"] = check_retention_interval(
        f"{where}.prefix_cache_retention_interval", e["prefix_cache_retention_interval"], sem,
        groups, eagle=method in EAGLE_METHODS)
    return _build(EngineCfg, e)


def _check_kv_role(e: dict, where: str, sem: Semantics) -> None:
    """A P/D role (NixlConnector) as kvsim reproduces it, and the extra config each connector
    takes."""
    pd = e["kv_role"] != "kv_both"
    extra = e["kv_connector_extra_config"] or {}
    for key in extra:
        if key in PD_ONLY_EXTRA and not pd:
            raise ConfigError(f"{where}.kv_connector_extra_config.{key}", "configures "
                              "NixlConnector: only with kv_role kv_producer or kv_consumer")
        if key in OFFLOAD_ONLY_EXTRA and not e["kv_offloading_size"]:
            raise ConfigError(f"{where}.kv_connector_extra_config.{key}", "configures the "
                              "offloading connector: only with kv_offloading_size")
    if not pd:
        return
    if e["kv_offloading_size"]:
        raise ConfigError(f"{where}.kv_role", "P/D together with a CPU offload tier (vLLM's "
                          "MultiConnector) is not modelled yet")
    if e["data_parallel_size"] > 1:
        raise ConfigError(f"{where}.kv_role", "P/D instances with data_parallel_size > 1 are "
                          "not modelled yet")
    check_pd(f"{where}.kv_role", sem, e["kv_groups"] is not None)


def _offload(e: dict, where: str, file: str, sem: Semantics, method: str, hw: HardwareCfg,
             block_bytes: int) -> OffloadParams | None:
    """The CPU offload tier ``--kv-offloading-size`` and the connector's extra config make."""
    extra = e["kv_connector_extra_config"]
    if not e["kv_offloading_size"]:  # left out, or 0: no tier
        return None
    if e["kv_offloading_backend"] != "native":
        raise ConfigError(f"{where}.kv_offloading_backend", "'lmcache' keeps the tier in an "
                          "LMCache server, which kvsim does not model; use 'native'")
    x = extra or {}
    bpc = x.get("blocks_per_chunk") or 1
    if "block_size" in x:
        if "blocks_per_chunk" in x:
            raise ConfigError(f"{where}.kv_connector_extra_config", "give block_size or "
                              "blocks_per_chunk, not both (vLLM refuses both)")
        if x["block_size"] % e["block_size"]:
            raise ConfigError(f"{where}.kv_connector_extra_config.block_size",
                              f"{x['block_size']} must be a multiple of the GPU block size "
                              f"({e['block_size']})")
        bpc = x["block_size"] // e["block_size"]
    params = OffloadParams(
        num_chunks=num_cpu_chunks(e["kv_offloading_size"], block_bytes,
                                  e["tensor_parallel_size"], bpc),
        blocks_per_chunk=bpc, offload_prompt_only=x.get("offload_prompt_only", True),
        store_threshold=x.get("store_threshold", 0), eviction_policy=x.get("eviction_policy", "lru"))
    check_offload(f"{where}.kv_offloading_size", params, sem, method,
                  e["kv_groups"] is not None, e["enable_prefix_caching"])
    if hw.host_link_bandwidth_bytes_per_s is None:
        raise ConfigError(f"{file}: hardware.host_link_bandwidth_bytes_per_s", "needed with "
                          "engine.kv_offloading_size (offload transfers cross the GPU's host link)")
    return params


def _layout(model: ModelCfg, hw: HardwareCfg, e: dict, sem: Semantics, num_spec: int,
            file: str) -> KVLayout:
    """The KV layout vLLM derives for the model on this engine and GPU (kvsim.layout)."""
    try:
        return derive_layout(
            model, sem.layout, tp=e["tensor_parallel_size"], kv_cache_dtype=e["kv_cache_dtype"],
            block_size=e["block_size"], capability=hw.capability,
            enable_prefix_caching=e["enable_prefix_caching"],
            mamba_cache_mode_given=e["mamba_cache_mode"], num_speculative_tokens=num_spec)
    except ConfigError as exc:  # a key the derivation needs (hardware.compute_capability)
        raise ConfigError(f"{file}{exc.where}", f"{exc.what} (or set engine.block_size and "
                          "engine.kv_groups by hand)" if exc.where.startswith("hardware") else
                          exc.what) from None


def check_groups_for_release(where: str, groups, sem: Semantics) -> None:
    """Refuse group settings the release does not have (vLLM would reject the spec field)."""
    for i, g in enumerate(groups or ()):
        if g.prefill_checkpoint_alignment is not None and not sem.has_mamba_prefill_checkpoints:
            raise ConfigError(f"{where}[{i}].prefill_checkpoint_alignment", f"vLLM {sem.version} "
                              "has no prefill checkpoints inside a chunk (0.32 and later)")


def check_retention_interval(where: str, value: int | str | None, sem: Semantics,
                             groups, eagle: bool = False) -> int | str:
    """The release's default when ``value`` is None, else ``value`` if vLLM accepts it
    (kv_cache_coordinator.py _validate_prefix_cache_retention_interval, 0.32+). ``eagle``:
    an EAGLE-family drafter is on (0.29 defaults a Mamba hybrid with one to dense)."""
    if value is None:
        d = sem.default_prefix_cache_retention_interval
        if sem.retention_dense_for_hybrid_eagle and eagle and any(
                g.kind == "mamba" for g in groups or ()):
            d = None
        return "dense" if d is None else d
    if isinstance(value, str):  # "dense", the only string the key takes
        return value
    if sem.retention_setting == "none":
        raise ConfigError(where, f"vLLM {sem.version} has no such setting (its checkpoints are "
                          "dense); leave it out or set it to \"dense\"")
    kinds = ("sliding_window", "mamba") if sem.hybrid.mamba_retention else ("sliding_window",)
    if (value > 0 or sem.retention_setting == "env") and not any(
            g.kind in kinds for g in groups or ()):
        # 0.23-0.28 take it from VLLM_PREFIX_CACHE_RETENTION_INTERVAL and refuse any value there.
        name = ("VLLM_PREFIX_CACHE_RETENTION_INTERVAL" if sem.retention_setting == "env"
                else "prefix_cache_retention_interval")
        raise ConfigError(where, f"{value} has no effect without a {' or '.join(kinds)} group in "
                          f"engine.kv_groups (vLLM {sem.version} refuses {name} then); "
                          + ("leave it out" if sem.retention_setting == "env" else "set it to 0"))
    if value > 0:
        unit = math.lcm(*(g.block_size for g in groups))
        if value % unit:
            raise ConfigError(where, f"{value} must be a multiple of the scheduler block size "
                              f"({unit}, the lcm of the group block sizes)")
    return value


def _workload(raw: dict, file: str, base: Path | None) -> WorkloadCfg:
    w = _section(raw, "workload", file)
    where = f"{file}: workload"
    lengths = w["kind"] == "synthetic" and w["generator"] == "trace_lengths"
    reads = w["kind"] == "trace" or w["arrival"] == "trace" or lengths
    if reads:
        if w["trace"] is not None and w["path"] is not None:
            raise ConfigError(f"{where}.trace", "give trace (a known name) or path (a file), not both")
        if w["trace"] is not None:
            t = traces.known(w["trace"], f"{where}.trace")
            if w["format"] is not None and w["format"] != t.format:
                raise ConfigError(f"{where}.format", f"trace {t.name!r} is in format {t.format!r}, "
                                  f"not {w['format']!r}")
            w["format"] = t.format
            w["path"] = traces.locate(t.name, f"{where}.trace")
        elif w["path"] is None:
            need = ("kind = 'trace'" if w["kind"] == "trace" else
                    "generator = 'trace_lengths'" if lengths else "arrival = 'trace'")
            raise ConfigError(f"{where}.path", f"missing ({need} reads a file: give path, or trace "
                              "= a known trace name)")
        else:
            p = Path(w["path"]).expanduser()
            if not p.is_absolute() and base is not None:
                p = base / p
            if not p.is_file():
                what = "is a directory, not a trace file" if p.is_dir() else "no such file"
                raise ConfigError(f"{where}.path", f"{what}: {p}")
            w["path"] = p
        if w["window_end_s"] is not None and w["window_end_s"] <= w["window_start_s"]:
            raise ConfigError(f"{where}.window_end_s", f"{w['window_end_s']} must be greater than "
                              f"window_start_s ({w['window_start_s']})")
    else:
        for key in ("path", "trace"):
            if w[key] is not None:
                raise ConfigError(f"{where}.{key}", "only used with kind = 'trace', arrival = "
                                  "'trace' or generator = 'trace_lengths'")
    w["format"] = w["format"] or "kvsim"
    if w["kind"] == "synthetic" and w["generator"] == "rag" and (
            w["documents_per_request"] > w["num_documents"]):
        raise ConfigError(f"{where}.documents_per_request", f"{w['documents_per_request']} exceeds "
                          f"num_documents ({w['num_documents']})")
    if w["random_range_rule"] == "centered" and w["random_range_ratio"] >= 1:
        raise ConfigError(f"{where}.random_range_ratio", f"{w['random_range_ratio']} must be below "
                          "1 with random_range_rule = 'centered' (vllm bench serve refuses it)")
    mean, sd = w["acceptance_rate_mean"], w["acceptance_rate_sd"]
    if mean is not None and 0 < mean < 1 and sd * sd >= mean * (1 - mean):
        raise ConfigError(f"{where}.acceptance_rate_sd", f"{sd} is too large for mean {mean}: a beta "
                          f"distribution needs sd < sqrt(mean * (1 - mean)) = "
                          f"{math.sqrt(mean * (1 - mean)):.4g}")
    return _build(WorkloadCfg, w)


def _num_speculative_tokens(s: dict, model: ModelCfg) -> Any:
    """``num_speculative_tokens`` as given, else vLLM's default for MTP (SpeculativeConfig: the
    checkpoint's MTP layers); None when missing (checked in ``_speculative``)."""
    k = s.get("num_speculative_tokens")
    if k is None and s.get("method") == "mtp" and model.num_nextn_predict_layers:
        return model.num_nextn_predict_layers
    return k


def _speculative(raw: dict, file: str, engine: EngineCfg, model: ModelCfg) -> SpecCfg:
    s = _section(raw, "speculative", file)
    where = f"{file}: speculative"
    if s["method"] == "none":  # the other keys are inert (variants switch the method alone)
        return _build(SpecCfg, {**s, "num_speculative_tokens": 0, "num_accepted": 0})
    if s["method"] == "mtp" and not model.num_nextn_predict_layers:
        raise ConfigError(f"{where}.method", f"'mtp' needs a model with MTP layers; "
                          f"{model.name} has none (model.num_nextn_predict_layers = 0), and vLLM "
                          "refuses it: use a drafter ('eagle3', 'draft_model') or 'ngram'")
    k = s["num_speculative_tokens"] = _num_speculative_tokens(s, model)
    if k is None:
        raise ConfigError(f"{where}.num_speculative_tokens", f"missing (required with method = "
                          f"'{s['method']}')")
    if len(s["acceptance_rates"]) not in (1, k):
        raise ConfigError(f"{where}.acceptance_rates", f"{len(s['acceptance_rates'])} rates for "
                          f"{k} drafts: give one for every position, or one per draft")
    sem = engine.semantics
    for flag, ok in (("disable_eagle_block_drop", sem.has_disable_eagle_block_drop),
                     ("disable_lookahead_block_hashes", sem.has_disable_lookahead_block_hashes)):
        if s[flag] and not ok:
            raise ConfigError(f"{where}.{flag}", f"vLLM {engine.vllm_version} has no such option")
    if s["acceptance"] == "fixed":
        if s["num_accepted"] is None:
            raise ConfigError(f"{where}.num_accepted", "missing (required with acceptance = 'fixed')")
        if s["num_accepted"] > k:
            raise ConfigError(f"{where}.num_accepted", f"{s['num_accepted']} exceeds "
                              f"num_speculative_tokens ({k})")
    s["num_accepted"] = s["num_accepted"] or 0
    if s["draft_model"] is not None:
        if s["method"] != "draft_model":
            raise ConfigError(f"{where}.draft_model", "only used with method = 'draft_model'")
        model_preset(s["draft_model"], f"{where}.draft_model")
    if s["parallel_drafting"] and s["method"] not in ("eagle", "eagle3", "draft_model"):
        raise ConfigError(f"{where}.parallel_drafting", "only EAGLE and draft models draft in parallel")
    if engine.max_num_batched_tokens <= k:
        raise ConfigError(f"{file}: engine.max_num_batched_tokens", f"{engine.max_num_batched_tokens} "
                          f"leaves no room for {k} lookahead slots (vLLM refuses it)")
    spec = _build(SpecCfg, s)
    if not sem.per_request_draft_slots:
        slots = derive_spec(spec.drafting(model.num_nextn_predict_layers), sem,
                            engine.enable_prefix_caching, engine.block_size).params.draft_slots
        reserved_token_budget(sem, engine.max_num_batched_tokens, engine.max_num_seqs, slots,
                              where=f"{file}: engine.max_num_batched_tokens")
    return spec


def _cost(raw: dict, file: str, base: Path | None, model: ModelCfg, engine: EngineCfg,
          hw: HardwareCfg, client: bool = False) -> CostCfg:
    """[cost]; ``client``: a benchmark client sends the requests (the frontend's latency)."""
    from kvsim.cost import fitted  # the profile reader (JSON); no numpy

    c = _section(raw, "cost", file)
    if c["model"] is None:
        c["model"] = ("interpolated" if c["layer_profile"] else "fitted" if c["profile"]
                      else "roofline")
    where = f"{file}: cost.profile"
    if c["model"] == "fitted":
        if not c["profile"]:
            raise ConfigError(f"{file}: cost.model", "'fitted' needs cost.profile (kvsim calibrate "
                              "writes one)")
        try:
            path = fitted.resolve_profile(c["profile"], base)
            profile = fitted.load_profile(path)
        except ConfigError as exc:
            raise ConfigError(where, exc.what if exc.where == "cost.profile" else str(exc)) from None
        fitted.check_matches(profile, model, engine.tensor_parallel_size, where)
        c["profile"] = str(path.resolve())
    elif c["profile"]:
        raise ConfigError(where, "is used only with cost.model = 'fitted'")
    if c["model"] == "interpolated":
        c["layer_profile"] = str(_layer_profile(c["layer_profile"], file, base, model, engine))
    elif c["layer_profile"]:
        raise ConfigError(f"{file}: cost.layer_profile", "is used only with cost.model = "
                          "'interpolated'")
    generation, fitted_roofline = roofline_generation(hw.compute_capability)
    given = [k for k, v in fitted_roofline.items()
             if k != "frontend_latency_s" and c[k] not in (None, v)]  # the step's constants
    c["roofline_constants"] = ("[cost] constants" if given else "uncalibrated"
                               if generation == "default" else f"fitted for {generation}")
    for key in ("compute_efficiency", "moe_compute_efficiency", "bandwidth_efficiency",
                "attention_bandwidth_efficiency"):
        if c[key] is None:
            c[key] = fitted_roofline[key]
    if c["step_overhead_s"] is None:
        c["step_overhead_s"] = (0.0 if c["model"] == "interpolated" else
                                fitted_roofline["step_overhead_s"] if c["model"] == "roofline"
                                else 0.002)
    if c["step_overhead_per_request_s"] is None:
        c["step_overhead_per_request_s"] = (fitted_roofline["step_overhead_per_request_s"]
                                            if c["model"] == "roofline" else 0.0)
    if c["frontend_latency_s"] is None:
        c["frontend_latency_s"] = fitted_roofline["frontend_latency_s"] if client else 0.0
    if c["model"] == "roofline" and hw.peak_flops_per_s is None:
        raise ConfigError(f"{file}: hardware.peak_flops_per_s", "missing: the roofline cost model "
                          "needs it (or give cost.profile, a fitted profile)")
    return _build(CostCfg, c)


@functools.cache
def _roofline_table() -> dict:
    return tomllib.loads((resources.files("kvsim") / "presets" / "roofline.toml").read_text())


def roofline_generation(compute_capability: str | None) -> tuple[str, dict[str, float]]:
    """(name, constants) of the GPU generation whose table in kvsim/presets/roofline.toml lists
    ``compute_capability``; ("default", its table) for one no table lists."""
    tables = _roofline_table()
    for name, table in tables.items():
        if compute_capability in table.get("compute_capabilities", ()):
            return name, {k: v for k, v in table.items() if k != "compute_capabilities"}
    return "default", dict(tables["default"])


def _layer_profile(name: str | None, file: str, base: Path | None, model: ModelCfg,
                   engine: EngineCfg) -> Path:
    """The checked layer-profile folder of ``[cost] layer_profile``."""
    from kvsim.cost import interpolated

    where = f"{file}: cost.layer_profile"
    if not name:
        raise ConfigError(f"{file}: cost.model", "'interpolated' needs cost.layer_profile (a folder "
                          "of vLLM layer profiles)")
    folder = Path(name).expanduser()
    if not folder.is_absolute() and base is not None:
        folder = base / folder
    if not folder.is_dir():
        raise ConfigError(where, f"no folder {str(folder)!r}")
    tp = engine.tensor_parallel_size
    if not (folder / f"tp{tp}").is_dir():
        profiled = ", ".join(map(str, interpolated.tp_degrees(folder))) or "none"
        raise ConfigError(where, f"{folder} has no tp{tp}/ (tensor_parallel_size {tp}; "
                          f"profiled: {profiled})")
    interpolated.check_model(folder, model, tp, where)
    return folder.resolve()


def parse_scenario(raw: dict, path: Path | None = None) -> Scenario:
    """Validate a scenario table (as ``tomllib`` returns it). Raises ConfigError."""
    file = path.name if path else "scenario"
    for section, table in raw.items():
        if section not in SCHEMA:
            raise ConfigError(f"{file}: [{section}]", f"unknown section{_suggest(section, list(SCHEMA))}")
        if not isinstance(table, dict):
            raise ConfigError(f"{file}: {section}", f"must be a table ([{section}])")
    model = _model(raw, file, path.parent if path else None)
    if model.num_experts and not 1 <= model.num_experts_per_tok <= model.num_experts:
        raise ConfigError(f"{file}: model.num_experts_per_tok", f"must be between 1 and num_experts "
                          f"({model.num_experts}) for an MoE model, got {model.num_experts_per_tok}")
    if model.attention_type == "mla" and model.kv_lora_rank <= 0:
        # MLA caches one latent of kv_lora_rank + qk_rope_head_dim values a token.
        raise ConfigError(f"{file}: model.kv_lora_rank", f"must be above 0 for attention_type 'mla' "
                          f"(the cached latent's width), got {model.kv_lora_rank}")
    hardware = _build(HardwareCfg, _section(raw, "hardware", file))
    cc = hardware.compute_capability
    if cc is not None and not re.fullmatch(r"\d{1,2}\.\d", cc):
        raise ConfigError(f"{file}: hardware.compute_capability", f"must be 'major.minor' like "
                          f"'9.0', got {cc!r}")
    engine = _engine(raw, file, model, hardware)
    if "cluster" not in raw:
        _check_cluster_size(f"{file}: engine.data_parallel_size", [engine])
        if engine.kv_role != "kv_both":
            raise ConfigError(f"{file}: engine.kv_role", "a P/D role needs a [cluster] of "
                              "prefill and decode instances ([[cluster.deployment]] tables)")
    speculative = _speculative(raw, file, engine, model)
    workload = _workload(raw, file, path.parent if path else None)
    if (workload.acceptance_rate_mean is not None and speculative.enabled
            and speculative.acceptance != "trace"):
        raise ConfigError(f"{file}: workload.acceptance_rate_mean", "generated acceptances are used "
                          "only with speculative.acceptance = 'trace'")
    if workload.client and ("cluster" in raw or engine.data_parallel_size > 1):
        key = "max_concurrency" if workload.max_concurrency is not None else "num_warmups"
        raise ConfigError(f"{file}: workload.{key}", "a benchmark client runs in front of one "
                          "engine only, not yet a [cluster] or data-parallel ranks")
    base = path.parent if path else None
    return Scenario(
        path=path,
        model=model,
        hardware=hardware,
        engine=engine,
        speculative=speculative,
        workload=workload,
        cost=_cost(raw, file, base, model, engine, hardware, workload.client),
        run=_build(RunCfg, _section(raw, "run", file)),
        cluster=_cluster(raw, file, base, model, hardware, engine) if "cluster" in raw else None,
    )


def _cluster(raw: dict, file: str, base: Path | None, model: ModelCfg, hw: HardwareCfg,
             engine: EngineCfg) -> ClusterCfg:
    c = _section(raw, "cluster", file)
    deployments = c["deployment"]
    if deployments is None:
        _check_cluster_size(f"{file}: cluster.replicas", [engine] * c["replicas"])
        return _pd(raw, file, c, (engine,) * c["replicas"])
    total = sum(n for n, _ in deployments)
    if total > MAX_REPLICAS:
        raise ConfigError(f"{file}: cluster.deployment", f"{total:,} replicas in all, more than "
                          f"kvsim runs ({MAX_REPLICAS:,})")
    if "replicas" in raw["cluster"]:
        raise ConfigError(f"{file}: cluster.replicas", "give replicas or [[cluster.deployment]] "
                          "tables (whose replicas add up), not both")
    engines: list[EngineCfg] = []
    for i, (n, overrides) in enumerate(deployments):
        # A deployment's engine is [engine] with its keys replaced, checked like [engine].
        raw_d = {**raw, "engine": {**raw.get("engine", {}), **dict(overrides)}}
        try:
            e = _engine(raw_d, file, model, hw)
            _speculative(raw_d, file, e, model)
            _cost(raw_d, file, base, model, e, hw)
        except ConfigError as exc:
            inner = exc.where.removeprefix(f"{file}: ")
            where = inner.replace("engine.", f"cluster.deployment[{i}].", 1) if inner.startswith(
                "engine.") else f"cluster.deployment[{i}] ({inner})"
            raise ConfigError(f"{file}: {where}", exc.what) from None
        engines += [e] * n
    _check_cluster_size(f"{file}: cluster.deployment", engines)
    return _pd(raw, file, {**c, "replicas": len(engines)}, tuple(engines))


def _pd(raw: dict, file: str, c: dict, engines: tuple[EngineCfg, ...]) -> ClusterCfg:
    """The cluster with its P/D settings resolved: prefill and decode instances both, or
    neither; the link's bandwidth and latency from its preset."""
    where = f"{file}: cluster"
    roles = {e.kv_role for e in engines}
    if roles != {"kv_both"}:
        if "kv_both" in roles:
            raise ConfigError(f"{where}.deployment", "a P/D cluster's instances are kv_producer "
                              "or kv_consumer: aggregated (kv_both) replicas beside them are not "
                              "modelled")
        if roles != {"kv_producer", "kv_consumer"}:
            missing = ({"kv_producer", "kv_consumer"} - roles).pop()
            raise ConfigError(f"{where}.deployment", f"P/D needs both prefill (kv_producer) and "
                              f"decode (kv_consumer) instances; no deployment is {missing}")
    # (Without P/D instances the P/D keys go unused, so that one scenario compares an
    # aggregated cluster with P/D splits: kvsim compare --vary cluster.deployment=...)
    bandwidth, latency, _ = KV_TRANSFER_LINKS[c["kv_transfer_link"]]
    return _build(ClusterCfg, {
        **c, "engines": engines, "prefill_router": c["prefill_router"] or c["router"],
        "kv_transfer_bandwidth_bytes_per_s": c["kv_transfer_bandwidth_bytes_per_s"] or bandwidth,
        "kv_transfer_latency_s": (latency if c["kv_transfer_latency_s"] is None
                                  else c["kv_transfer_latency_s"])})


def _check_cluster_size(where: str, engines: list[EngineCfg]) -> None:
    """Every replica's pools (one per data-parallel rank) are built: together within what
    kvsim holds."""
    ranks = sum(e.data_parallel_size for e in engines)
    if ranks > MAX_REPLICAS:
        raise ConfigError(where, f"{len(engines):,} replicas of their data_parallel_size make "
                          f"{ranks:,} engines, more than kvsim runs ({MAX_REPLICAS:,})")
    blocks = sum(e.num_gpu_blocks * e.data_parallel_size for e in engines)
    if blocks > MAX_GPU_BLOCKS:
        raise ConfigError(where, f"{len(engines):,} replicas hold {blocks:,} blocks in all, more "
                          f"than kvsim holds ({MAX_GPU_BLOCKS:,}); set engine.num_gpu_blocks "
                          "or fewer replicas")


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises ConfigError (missing file, bad TOML, bad key)."""
    return parse_scenario(load_raw(path), Path(path).resolve())


def load_raw(path: str | Path, what: str = "scenario file") -> dict:
    """A TOML file's table (a ``what``), unvalidated; every way of failing to read one is a
    ConfigError (missing, a folder, not text, not TOML, unreadable)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(str(p), "no such file") from None
    except IsADirectoryError:
        raise ConfigError(str(p), f"is a directory, not a {what}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(p), f"not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), f"not a text file (not UTF-8 at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(str(p), exc.strerror or str(exc)) from None
    return raw
