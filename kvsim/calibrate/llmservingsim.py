"""Turn LLMServingSim's published vLLM-layer GPU profiles into step rows for the same fit.

A profile folder (``profiles/<hardware>/<org>/<model>/<variant>/``) holds ``meta.yaml`` and one
``tp<N>/`` folder per tensor parallel size with layer times measured on a one-layer model
(vLLM's own kernels). Every ``attention.csv`` grid point becomes one target row and one
drafter row (``L = 1``), composed as ``kvsim.cost.interpolated.LayerProfile`` composes a pass
(the interpolated cost model reads the same folder directly); points past ``dense.csv``'s
token range are dropped. ``heldout_errors`` scores both step-time models on grid points left
out of what they are built from (``benchmarks/cost_modes.py`` prints it).
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


def _profile(folder: Path, tp: int, model: str | None) -> tuple[LayerProfile, int]:
    """The folder's full tables for ``tp`` and the model's layer count."""
    name = model or preset_for(read_meta(folder).get("model", ""))
    if name is None:
        raise ConfigError(str(folder), f"no kvsim model preset for {read_meta(folder).get('model')!r}")
    shape = model_preset(name)
    return LayerProfile(folder, tp, shape), shape.num_hidden_layers


def _fitted_errors(full: LayerProfile, layers: int, fitted_on: LayerProfile, scored: list[int],
                   seed: int, where: str) -> list[float]:
    """``predicted / measured - 1`` of the fitted form, fitted (``fit.fit_rows``) to
    ``fitted_on``'s composed target rows, on the grid points ``scored`` (indices into
    ``full.points``), each against the full tables' composed target pass. The prediction
    takes the run-time path (``GridStep.fitted_s``, ``kvsim.cost.fitted.features``), not the
    fit's own CSV features: the two must agree for the figure to mean anything."""
    from kvsim.calibrate import fit

    rows = [r for r in composed_rows(fitted_on, {}) if r["pass"] == "target"]
    params = fit.fit_rows(rows, where, seed, full.experts)["target"][0]
    out = []
    for i in scored:
        step = full.grid_step(*full.points[i][:4])
        out.append(step.fitted_s(params, full.experts) / (full.pass_us(step, layers) * 1e-6) - 1)
    return out


def _composed(full: LayerProfile) -> list[int]:
    """Indices of the grid points ``step_rows`` composes (none past ``dense.csv``'s tokens)."""
    return [i for i, (pc, _, nd, _, _) in enumerate(full.points) if 0 < pc + nd <= full.max_tokens]


def heldout_errors(folder: Path, tp: int, model: str | None = None, seed: int = 0) -> dict:
    """Both step-time models scored on grid points neither was built from.

    A seeded fifth of ``attention.csv``'s grid points (those ``step_rows`` composes) is left
    out; the interpolated model is the folder's tables without them, the fitted form is
    fitted to the rest's composed target rows. Each predicts every left-out point's composed
    target pass, the full tables' (the measured attention with the same dense layers).
    Returns ``{"interpolated": errors, "fitted": errors, "n": count}``, errors as numpy arrays
    of ``predicted / measured - 1``. Raises ConfigError (no preset, a folder that does not
    compose)."""
    import numpy as np

    full, layers = _profile(folder, tp, model)
    inside = _composed(full)
    rng = np.random.default_rng(seed)
    held = sorted(rng.choice(inside, len(inside) // 5, replace=False).tolist())
    out = set(held)
    train = LayerProfile(folder, tp, full.model, keep=[i for i in range(len(full.points)) if i not in out])
    interpolated = []
    for i in held:
        step = full.grid_step(*full.points[i][:4])
        interpolated.append(train.pass_us(step, layers) / full.pass_us(step, layers) - 1)
    fitted = _fitted_errors(full, layers, train, held, seed, str(folder))
    return {"interpolated": np.array(interpolated), "fitted": np.array(fitted), "n": len(held)}


def offslice_errors(folder: Path, tp: int, max_tokens: int = 1024, max_context: int = 8192,
                    model: str | None = None, seed: int = 0) -> dict:
    """The fitted form off the slice it was fitted to: what the interpolated model uses it for
    past its grid. Fitted to the composed target rows of the grid points with at most
    ``max_tokens`` tokens (prefill chunk plus decodes) and ``max_context`` tokens of context
    (prefill and decode), scored on every other composed point as ``heldout_errors`` scores.
    Returns ``{"fitted": errors, "n": count, "num_fitted": count}``."""
    import numpy as np

    full, layers = _profile(folder, tp, model)
    inside = _composed(full)

    def in_slice(point) -> bool:
        pc, kp, nd, kd, _ = point
        return pc + nd <= max_tokens and kp <= max_context and kd <= max_context

    fitted_on = [i for i in inside if in_slice(full.points[i])]
    scored = [i for i in inside if not in_slice(full.points[i])]
    if not fitted_on or not scored:
        raise ConfigError(str(folder), f"the slice (<= {max_tokens} tokens, <= {max_context} "
                          "context) leaves nothing to fit or nothing to score")
    train = LayerProfile(folder, tp, full.model, keep=fitted_on)
    errors = _fitted_errors(full, layers, train, scored, seed, str(folder))
    return {"fitted": np.array(errors), "n": len(scored), "num_fitted": len(fitted_on)}
