"""Turn LLMServingSim's published vLLM-layer GPU profiles into step rows for the same fit.

A profile folder (``profiles/<hardware>/<org>/<model>/<variant>/``) holds ``meta.yaml`` and one
``tp<N>/`` folder per tensor parallel size with layer times measured on a one-layer model
(vLLM's own kernels). Every ``attention.csv`` grid point becomes one target row and one
drafter row (``L = 1``), composed as ``kvsim.cost.interpolated.LayerProfile`` composes a pass
(the interpolated cost model reads the same folder directly); points past ``dense.csv``'s
token range are dropped.
"""

from __future__ import annotations

from pathlib import Path

from kvsim import presets
from kvsim.config import model_preset
from kvsim.cost.fitted import SHAPE_KEYS
from kvsim.cost.interpolated import LayerProfile, composed_rows, read_meta
from kvsim.errors import ConfigError


def preset_for(hf_model: str) -> str | None:
    """The kvsim model preset whose ``hf_id`` is ``hf_model`` (an ``-Instruct`` suffix ignored)."""
    return presets.by_hf_id(hf_model, ignore_instruct=True)


def step_rows(folder: Path, tp: int, model: str | None = None) -> tuple[list[dict], dict]:
    """Composed target and draft rows (CSV-ready dicts) for ``tp``, and the import's provenance."""
    meta = read_meta(folder)
    hf_model = meta.get("model", "")
    name = model or preset_for(hf_model)
    if name is None:
        raise ConfigError(str(folder), f"no kvsim model preset for {hf_model!r}; pass --model")
    shape = model_preset(name)
    layers = LayerProfile(folder, tp, shape)
    common = {"source": f"llmservingsim:{hf_model}", "device": meta.get("gpu", ""),
              "torch_version": f"vllm {meta.get('vllm_version', '?')}", "dtype": meta.get("variant", ""),
              "model": name, **{k: getattr(shape, k) for k in SHAPE_KEYS}, "tensor_parallel_size": tp,
              "num_layers_timed": 1}
    rows = composed_rows(layers, common)
    parts = folder.resolve().parts
    shown = "/".join(parts[parts.index("profiles"):]) if "profiles" in parts else str(folder)
    provenance = {"importer": "llmservingsim", "folder": shown, "hf_model": hf_model,
                  "gpu": meta.get("gpu", ""), "vllm_version": meta.get("vllm_version", ""),
                  "cuda_version": meta.get("cuda_version", ""), "profiled_at": meta.get("profiled_at", ""),
                  "composition": "L*(attention + dense ops + 2nd layernorm) + embedding + final "
                                 "norm + lm_head + sampler; draft: L = 1"}
    return rows, provenance
