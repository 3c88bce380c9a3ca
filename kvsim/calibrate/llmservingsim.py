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
are interpolated linearly in ``T``; points past the profiled token range are dropped. MoE
profiles (``moe.csv``) are not composed yet.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

from kvsim import presets
from kvsim.cost.fitted import SHAPE_KEYS
from kvsim.errors import ConfigError

# Ops applied once per step rather than once per layer.
ONCE_PER_STEP = ("embedding", "final_layernorm")


def read_meta(folder: Path) -> dict[str, str]:
    """Top-level scalar keys of ``meta.yaml`` (model, gpu, vllm_version, ...); no YAML library."""
    path = folder / "meta.yaml"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(folder), "no meta.yaml (expected an LLMServingSim profile folder "
                          "profiles/<hardware>/<org>/<model>/<variant>)") from None
    out = {}
    for m in re.finditer(r"^([a-z_]+): *(.+)$", text, re.M):
        out[m.group(1)] = m.group(2).strip().strip("'\"")
    return out


def preset_for(hf_model: str) -> str | None:
    """The kvsim model preset whose ``hf_id`` is ``hf_model`` (an ``-Instruct`` suffix ignored)."""
    def base(s: str) -> str:
        return s.lower().removesuffix("-instruct")
    for name in presets.names("models"):
        hf_id = presets.load("models", name).get("hf_id", "")
        if base(hf_id) == base(hf_model):
            return name
    return None


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
    shape = presets.load("models", name)
    if shape is None:
        raise ConfigError("--model", f"unknown model preset {name!r}; known: "
                          f"{', '.join(presets.names('models'))}")
    sub = folder / f"tp{tp}"
    if (sub / "moe.csv").exists():
        raise ConfigError(str(sub), "MoE profiles (moe.csv) are not composed yet")
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
    once = sum(dense_us(op, tokens) for op in ONCE_PER_STEP if op in dense)
    head = np.interp(sampled, *per_seq["lm_head"]) + np.interp(sampled, *per_seq["sampler"])
    layers = int(shape["num_hidden_layers"])
    common = {"source": f"llmservingsim:{hf_model}", "device": meta.get("gpu", ""),
              "torch_version": f"vllm {meta.get('vllm_version', '?')}", "dtype": meta.get("variant", ""),
              "model": name, **{k: shape[k] for k in SHAPE_KEYS}, "tensor_parallel_size": tp,
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


def tp_degrees(folder: Path) -> list[int]:
    """The tensor parallel sizes profiled in ``folder`` (its ``tp<N>`` subfolders)."""
    return sorted(int(p.name[2:]) for p in folder.glob("tp[0-9]*") if p.is_dir() and p.name[2:].isdigit())

