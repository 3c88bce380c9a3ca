"""Turn LLMServingSim's published vLLM-layer GPU profiles into step rows for the same fit.

A profile folder (``profiles/<hardware>/<org>/<model>/<variant>/``) holds ``meta.yaml`` and one
``tp<N>/`` folder per tensor parallel size with layer times measured on a one-layer model
(vLLM's own kernels): ``attention.csv`` (prefill chunk, its KV context, decode count, decode
context -> µs), ``dense.csv`` (per layer type x tokens -> µs) and ``per_sequence.csv``
(``lm_head``, ``sampler`` x sequences -> µs). One step over an ``attention.csv`` grid point
is composed as::

    L · (attention + Σ per-layer dense ops(T) + a second layernorm(T))
      + embedding(T) + final_layernorm(T) + lm_head(S) + sampler(S)

with ``T`` the step's tokens and ``S`` its sampling requests (every decode sequence and the
prefill chunk); the drafter's pass (EAGLE/MTP head) is the same with ``L = 1``. Dense times
are interpolated linearly in ``T``; points past the profiled token range are dropped. An MoE
model's layers add ``moe.csv``'s fused-MoE time (tokens x activated experts -> µs) at the
experts ``T`` tokens are expected to activate under uniform top-k routing,
``N·(1 − (1 − k/N)^T)`` (linear in the expert count, then in ``T``).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import yaml

from kvsim import presets
from kvsim.config import model_preset
from kvsim.cost.fitted import SHAPE_KEYS, expert_share
from kvsim.errors import ConfigError

# Ops applied once per step rather than once per layer.
ONCE_PER_STEP = ("embedding", "final_layernorm")


def read_meta(folder: Path) -> dict[str, str]:
    """Top-level scalar keys of ``meta.yaml`` (model, gpu, vllm_version, ...), as text."""
    path = folder / "meta.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(str(folder), "no meta.yaml (expected an LLMServingSim profile folder "
                          "profiles/<hardware>/<org>/<model>/<variant>)") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"cannot read it: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "must be a YAML mapping of keys to values")
    return {str(k): str(v) for k, v in data.items() if not isinstance(v, dict | list)}


def preset_for(hf_model: str) -> str | None:
    """The kvsim model preset whose ``hf_id`` is ``hf_model`` (an ``-Instruct`` suffix ignored)."""
    return presets.by_hf_id(hf_model, ignore_instruct=True)


def _table(path: Path, key: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{op: (sizes, µs)}`` of a dense/per-sequence CSV, sorted by size."""
    ops: dict[str, list] = {}
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            need = ("layer", key, "time_us")
            if any(c not in (reader.fieldnames or ()) for c in need):
                raise ConfigError(str(path), f"missing columns (expected {', '.join(need)})")
            for r in reader:
                ops.setdefault(r["layer"], []).append((float(r[key]), float(r["time_us"])))
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file") from None
    out = {}
    for op, pts in ops.items():
        pts.sort()
        out[op] = (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    return out


def step_rows(folder: Path, tp: int, model: str | None = None) -> tuple[list[dict], dict]:
    """Composed target and draft rows (CSV-ready dicts) for ``tp``, and the import's provenance."""
    meta = read_meta(folder)
    hf_model = meta.get("model", "")
    name = model or preset_for(hf_model)
    if name is None:
        raise ConfigError(str(folder), f"no kvsim model preset for {hf_model!r}; pass --model")
    shape = model_preset(name)
    sub = folder / f"tp{tp}"
    if not sub.is_dir():
        raise ConfigError(str(sub), f"no profile for tensor_parallel_size {tp} (profiled: "
                          f"{', '.join(map(str, tp_degrees(folder))) or 'none'})")
    num_experts, top_k = shape.num_experts, shape.num_experts_per_tok
    moe = _moe_table(sub / "moe.csv") if num_experts else None
    if moe is None and (sub / "moe.csv").exists():
        raise ConfigError(str(sub), f"moe.csv profiles an MoE model, but preset {name!r} has no "
                          "num_experts")
    dense = _table(sub / "dense.csv", "tokens")
    per_seq = _table(sub / "per_sequence.csv", "sequences")
    for op in ("lm_head", "sampler"):
        if op not in per_seq:
            raise ConfigError(str(sub / "per_sequence.csv"), f"no {op!r} rows")
    max_tokens = min(float(v[0][-1]) for v in dense.values())

    def dense_us(op, t):
        return np.interp(t, *dense[op])

    try:
        att = np.loadtxt(sub / "attention.csv", delimiter=",", skiprows=1, ndmin=2)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(sub / "attention.csv"), f"cannot read: {exc}") from None
    if att.shape[1] != 5:
        raise ConfigError(str(sub / "attention.csv"), "expected columns prefill_chunk, kv_prefill, "
                          "n_decode, kv_decode, time_us")
    pc, kp, nd, kd, attn_us = att.T
    tokens = pc + nd
    keep = (tokens > 0) & (tokens <= max_tokens)
    pc, kp, nd, kd, attn_us, tokens = (a[keep] for a in (pc, kp, nd, kd, attn_us, tokens))
    sampled = nd + (pc > 0)
    per_layer = attn_us + sum(dense_us(op, tokens) for op in dense if op not in ONCE_PER_STEP)
    per_layer += dense_us("layernorm", tokens)  # pre-attention and pre-MLP norms
    if moe is not None:
        per_layer += _moe_us(moe, tokens, np.asarray(num_experts * expert_share(tokens, num_experts, top_k)))
    once = sum(dense_us(op, tokens) for op in ONCE_PER_STEP if op in dense)
    head = np.interp(sampled, *per_seq["lm_head"]) + np.interp(sampled, *per_seq["sampler"])
    layers = shape.num_hidden_layers
    common = {"source": f"llmservingsim:{hf_model}", "device": meta.get("gpu", ""),
              "torch_version": f"vllm {meta.get('vllm_version', '?')}", "dtype": meta.get("variant", ""),
              "model": name, **{k: getattr(shape, k) for k in SHAPE_KEYS}, "tensor_parallel_size": tp,
              "num_layers_timed": 1}
    rows = []
    for pass_name, num_layers in (("target", layers), ("draft", 1)):
        step_us = num_layers * per_layer + once + head
        for i in range(len(pc)):
            rows.append({**common, "pass": pass_name, "num_prefill_tokens": int(pc[i]),
                         "prefill_context": int(kp[i]), "num_decode_seqs": int(nd[i]),
                         "decode_query_len": 1, "decode_context": int(kd[i]),
                         "num_sampled": int(sampled[i]), "step_s": f"{step_us[i] * 1e-6:.9g}"})
    parts = folder.resolve().parts
    shown = "/".join(parts[parts.index("profiles"):]) if "profiles" in parts else str(folder)
    provenance = {"importer": "llmservingsim", "folder": shown, "hf_model": hf_model,
                  "gpu": meta.get("gpu", ""), "vllm_version": meta.get("vllm_version", ""),
                  "cuda_version": meta.get("cuda_version", ""), "profiled_at": meta.get("profiled_at", ""),
                  "composition": "L*(attention + dense ops + 2nd layernorm) + embedding + final "
                                 "norm + lm_head + sampler; draft: L = 1"}
    return rows, provenance


def _moe_table(path: Path) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """``{tokens: (activated experts, µs)}`` of an LLMServingSim ``moe.csv``."""
    try:
        data = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file (the MoE model's fused-MoE profile)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from None
    if data.shape[1] != 3:
        raise ConfigError(str(path), "expected columns tokens, activated_experts, time_us")
    out = {}
    for t in np.unique(data[:, 0]):
        sel = data[data[:, 0] == t]
        sel = sel[np.argsort(sel[:, 1])]
        out[float(t)] = (sel[:, 1], sel[:, 2])
    return out


def _moe_us(table, tokens: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """Fused-MoE µs at ``tokens`` with ``experts`` activated: linear in the expert count at each
    profiled token count, then linear in tokens between them."""
    grid = np.array(sorted(table))
    at = np.array([[np.interp(e, *table[t]) for t in grid] for e in experts])
    return np.array([np.interp(t, grid, row) for t, row in zip(tokens, at)])


def tp_degrees(folder: Path) -> list[int]:
    """The tensor parallel sizes profiled in ``folder`` (its ``tp<N>`` subfolders)."""
    return sorted(int(p.name[2:]) for p in folder.glob("tp[0-9]*") if p.is_dir() and p.name[2:].isdigit())

