"""A step-time model fitted to measured steps (a calibration profile), in place of the roofline.

One forward pass over a step's chunks ``(n new tokens, c tokens of context before them)`` with
``S`` sampling requests costs::

    T = Σ n                    tokens through the linear layers
    A = Σ n · (c + (n + 1)/2)  causal attention pairs (prefill attention compute)
    K = Σ (c + n)              KV entries read (decode attention memory traffic)
    R = #chunks                sequences in the batch (per-sequence kernels, metadata)

    time = t0 + (w^p + (a_tok · T)^p)^(1/p) + a_attn · A + a_kv · K + a_seq · R + a_lm · S

``t0`` is the fixed per-step overhead, ``w`` the weight-read time (the linear layers are
memory bound for few tokens and compute bound for many: a smooth roofline with knee sharpness
``p``), ``a_tok`` the linear FLOPs per token, ``a_attn`` and ``a_kv`` the attention terms in
context length, ``a_seq`` the per-sequence cost, ``a_lm`` the LM head and sampler per sampled
row. A profile holds one such set for the target model and one for the drafter's own pass (an
EAGLE/MTP head: one decoder layer plus the LM head), or, with ``"draft_in_target": true``, one
set fitted to whole engine steps whose times include the drafter's passes. ``kvsim calibrate``
writes profiles; ``[cost] profile`` selects one. Pure Python: no numpy, no torch.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from kvsim.errors import ConfigError

PARAMS = ("t0_s", "w_s", "p", "a_tok_s", "a_attn_s", "a_kv_s", "a_seq_s", "a_lm_s")
FORM = ("t0 + (w^p + (a_tok*T)^p)^(1/p) + a_attn*A + a_kv*K + a_seq*R + a_lm*S; "
        "T = sum n, A = sum n*(c+(n+1)/2), K = sum (c+n), R = #chunks, S = sampled rows")
# Model shape keys a profile must match (tensor parallel size is checked separately).
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "vocab_size")
PROFILE_FORMAT = "kvsim-cost-profile/1"


def features(chunks, num_sampled: int) -> tuple[float, float, float, float, float]:
    """``(T, A, K, R, S)`` of one pass over ``chunks`` (pairs ``(n, c)``)."""
    tokens = pairs = kv_read = 0.0
    num_chunks = 0
    for n, c in chunks:
        tokens += n
        pairs += n * (c + (n + 1) / 2)
        kv_read += c + n
        num_chunks += 1
    return tokens, pairs, kv_read, float(num_chunks), float(num_sampled)


def pass_time_s(params: dict[str, float], feats) -> float:
    """Seconds of one pass with coefficients ``params`` (see ``PARAMS``) for ``features(...)``."""
    tokens, pairs, kv_read, num_chunks, num_sampled = feats
    p = params["p"]
    linear = (params["w_s"] ** p + (params["a_tok_s"] * tokens) ** p) ** (1 / p)
    return (params["t0_s"] + linear + params["a_attn_s"] * pairs + params["a_kv_s"] * kv_read
            + params["a_seq_s"] * num_chunks + params["a_lm_s"] * num_sampled)


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped with kvsim (``kvsim/presets/profiles/*.json``)."""
    folder = resources.files("kvsim") / "presets" / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def resolve_profile(name: str, base: Path | None) -> Path:
    """The file of profile ``name``: a path (relative to ``base``) or a shipped profile's name."""
    p = Path(name).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    if p.is_file():
        return p
    shipped = resources.files("kvsim") / "presets" / "profiles" / f"{name}.json"
    if shipped.is_file():
        return Path(str(shipped))
    known = ", ".join(shipped_profiles())
    raise ConfigError("cost.profile", f"no profile file {str(p)!r} and no shipped profile named "
                      f"{name!r}; shipped: {known}")


def _check_pass(where: str, raw) -> dict[str, float]:
    if not isinstance(raw, dict):
        raise ConfigError(where, "must be a table of coefficients")
    out = {}
    for k in PARAMS:
        v = raw.get(k)
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or v != v:
            raise ConfigError(f"{where}.{k}", f"must be a non-negative number, got {v!r}")
        out[k] = float(v)
    if out["p"] < 1:
        raise ConfigError(f"{where}.p", f"must be at least 1, got {out['p']!r}")
    return out


def load_profile(path: Path) -> dict:
    """Read and check a profile file. Raises ConfigError naming the file."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(where, "no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(where, f"not a readable JSON profile: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ConfigError(where, f"not a kvsim cost profile (expected format {PROFILE_FORMAT!r})")
    model = data.get("model")
    if not isinstance(model, dict) or any(not isinstance(model.get(k), int) for k in SHAPE_KEYS):
        raise ConfigError(f"{where}: model", f"must give the model shape ({', '.join(SHAPE_KEYS)})")
    data["target"] = _check_pass(f"{where}: target", data.get("target"))
    if data.get("draft") is not None:
        data["draft"] = _check_pass(f"{where}: draft", data["draft"])
    tp = data.get("tensor_parallel_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"{where}: tensor_parallel_size", f"must be a positive integer, got {tp!r}")
    return data


def check_matches(profile: dict, model, tp: int, where: str) -> None:
    """Raise ConfigError unless ``profile`` was measured for ``model``'s shape at ``tp``."""
    pm = profile["model"]
    diff = [f"{k} {pm[k]} vs {getattr(model, k)}" for k in SHAPE_KEYS if pm[k] != getattr(model, k)]
    if diff:
        raise ConfigError(where, f"profile is for model {pm.get('name', '?')!r}, not {model.name!r} "
                          f"(profile vs scenario: {', '.join(diff)})")
    ptp = profile.get("tensor_parallel_size", 1)
    if ptp != tp:
        raise ConfigError(where, f"profile was measured at tensor_parallel_size {ptp}, the scenario "
                          f"runs {tp}")


class FittedCost:
    """Step times from a calibration profile (same interface as ``RooflineCost``)."""

    def __init__(self, model, hw, cost, tp: int, kv_cache_dtype: str = "auto", spec=None):
        if cost.profile is None:
            raise ConfigError("cost.model", "'fitted' needs cost.profile")
        profile = load_profile(Path(cost.profile))
        check_matches(profile, model, tp, "cost.profile")
        self.target = profile["target"]
        self.drafter = None
        self.num_draft_passes = 0
        # A profile timed from whole engine steps (``kvsim validate --against vllm-engine``)
        # has the drafter's passes inside its target coefficients.
        drafter_timed = profile.get("draft_in_target") is True
        if spec is not None and spec.enabled and spec.method != "ngram" and not drafter_timed:
            if spec.method == "draft_model":
                raise ConfigError("cost.profile", "a fitted profile has no draft-model pass; use the "
                                  "roofline for method = 'draft_model'")
            if profile.get("draft") is None:
                raise ConfigError("cost.profile", f"{cost.profile} has no drafter pass (needed for "
                                  f"speculative method {spec.method!r})")
            self.drafter = profile["draft"]
            self.num_draft_passes = spec.num_speculative_tokens
        err = profile.get("heldout_error") or {}
        self.label = (f"fitted ({profile.get('device', '?')}, {Path(cost.profile).stem}, held-out "
                      f"median {err.get('median_pct', float('nan')):.1f} %)")

    def step_time_s(self, chunks, num_sampled: int) -> float:
        """Seconds for the target model's step over ``chunks`` (pairs ``(n, c)``)."""
        return pass_time_s(self.target, features(chunks, num_sampled))

    def draft_time_s(self, chunks, num_sampled: int) -> float:
        """Seconds the drafter adds: one pass over the step's chunks, then k − 1 one-row passes."""
        if self.drafter is None or not num_sampled:
            return 0.0
        first = pass_time_s(self.drafter, features(chunks, num_sampled))
        # Later passes: one row per sampling request, at the batch's mean context.
        context = sum(c + n for n, c in chunks) / len(chunks)
        rest = pass_time_s(self.drafter, features([(1, context)] * num_sampled, num_sampled))
        return first + (self.num_draft_passes - 1) * rest
