"""A step-time model fitted to measured steps (a calibration profile), in place of the roofline.

One forward pass over a step's chunks ``(n new tokens, c tokens of context before them)`` with
``S`` rows through the LM head costs::

    T  = Σ n                        tokens through the linear layers
    Ap = Σ_prefill n·(c + (n+1)/2)  causal attention pairs of prefill chunks (compute)
    Kp = Σ_prefill (c + n)          KV entries prefill chunks read
    Kd = Σ_decode (c + n)           KV entries decode chunks read (memory traffic)
    R  = #chunks                    sequences in the batch (per-sequence kernels, metadata)
    L  = max (c + n)                the longest sequence
    E  = 1 − (1 − k/N)^T            MoE: the share of N routed experts T tokens of top-k touch

    pure decode step:  time = t0 + lin(T) + a_kv·Kd + a_seq·R + a_moe·E + a_lm·S
    with a prefill:    time = t0 + lin(T) + a_moe·E + a_lm·S + a_seq_mixed·R·[decodes too]
                              + ((a_attn·Ap + a_kv_prefill·Kp + a_kv_mixed·Kd)^q
                                 + (a_crit·L·[decodes too])^q)^(1/q)
    lin(T) = (w^p + (a_tok·T)^p)^(1/p)

A decode chunk is one of at most ``1 + num_speculative_tokens`` tokens (vLLM's attention
backends run those on their decode path, the rest as prefill). ``t0`` is the fixed per-step
overhead, ``w`` the weight-read time (the linear layers are memory bound for few tokens and
compute bound for many: a smooth roofline with knee sharpness ``p``), ``a_tok`` the linear FLOPs
per token, ``a_moe`` the time to read all routed experts' weights (an MoE layer reads only the
experts its tokens were routed to; ``E`` assumes uniform routing). Attention takes two paths,
as in vLLM's backends: a pure decode batch runs the decode kernel, which splits each
sequence's KV across the GPU (``a_kv``, ``a_seq``); a batch with a prefill chunk runs every
sequence through the variable-length prefill kernel, where decodes read their KV about twice as
slowly (``a_kv_mixed``, ``a_seq_mixed``) and one long sequence, walked by few thread blocks, sets
a critical path (``a_crit``; the larger of work and path, smoothly, knee ``q``). vLLM's own
layer profiles show both: one decode of 16,384 tokens of context costs 62 µs alone, ~5× more
beside a 16-token prefill chunk. ``a_lm`` is the LM head and sampler per row (one per sampling
request; 1 + k per verifying request). A profile holds one such set for the target model and
one for the drafter's own pass (an EAGLE/MTP head: one decoder layer plus the LM head), or,
with ``"draft_in_target": true``, one set fitted to whole engine steps whose times include the
drafter's passes (``"whole_engine_steps": true``: ``t0`` holds the engine's per-step overhead,
so ``[cost] step_overhead_s`` is not added). ``kvsim calibrate`` writes profiles; ``[cost]
profile`` selects one. Pure Python: no numpy, no torch.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from kvsim.cost.base import CostInputs, Decodes, drafter_passes
from kvsim.cost.comm import AllReduce
from kvsim.errors import ConfigError

PARAMS = ("t0_s", "w_s", "p", "a_tok_s", "a_attn_s", "a_kv_prefill_s", "a_kv_s", "a_kv_mixed_s",
          "a_crit_s", "q", "a_moe_s", "a_seq_s", "a_seq_mixed_s", "a_lm_s")
FORM = ("t0 + (w^p + (a_tok*T)^p)^(1/p) + a_moe*E + a_lm*S + [pure decode] a_kv*Kd + a_seq*R "
        "+ [with a prefill chunk] ((a_attn*Ap + a_kv_prefill*Kp + a_kv_mixed*Kd)^q + "
        "(a_crit*L*m)^q)^(1/q) + a_seq_mixed*R*m; T = sum n, Ap = sum_prefill n*(c+(n+1)/2), "
        "Kp = sum_prefill (c+n), Kd = sum_decode (c+n), R = #chunks, L = max (c+n), m = 1 when "
        "decode chunks run beside the prefill, E = 1-(1-top_k/num_experts)^T (0: dense), "
        "S = LM-head rows; decode chunk: n <= 1 + num_speculative_tokens")
# Model shape keys a profile must match (tensor parallel size is checked separately).
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "vocab_size", "num_experts", "num_experts_per_tok")
PROFILE_FORMAT = "kvsim-cost-profile/2"


def expert_share(tokens: float, num_experts: int, top_k: int) -> float:
    """The expected share of an MoE layer's ``num_experts`` routed experts that ``tokens``
    tokens, each routed to ``top_k`` of them uniformly, touch (0 for a dense model)."""
    if not num_experts:
        return 0.0
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def features(chunks, num_rows: int, max_decode_len: int = 1, experts: tuple[int, int] = (0, 0),
             decodes: Decodes | None = None):
    """``(T, Ap, Kp, Kd_pure, Kd_mixed, L_mixed, E, R_pure, R_mixed, S)`` of one pass over
    ``chunks`` (pairs ``(n, c)``) with ``num_rows`` LM-head rows: decode KV, the longest
    sequence and the chunk count go to the pure-decode or the mixed column by the step's kind
    (``L``/``R`` mixed only when decodes run beside a prefill). A chunk of at most
    ``max_decode_len`` tokens is a decode chunk; ``experts`` is ``(num_experts, top_k)``.
    ``decodes``: further decode chunks as ``Decodes`` (whole numbers: the sums are the floats
    chunk-by-chunk addition gives)."""
    tokens = pairs = kv_prefill = kv_decode = 0.0
    longest = 0.0
    num_chunks = num_prefill = 0
    if decodes is not None:
        num_chunks, kv_decode, longest = decodes[0], float(decodes[2]), float(decodes[3])
        tokens = float(num_chunks * decodes[1])
    for n, c in chunks:
        tokens += n
        length = c + n
        if n > max_decode_len:
            pairs += n * (c + (n + 1) / 2)
            kv_prefill += length
            num_prefill += 1
        else:
            kv_decode += length
        if length > longest:
            longest = length
        num_chunks += 1
    share = expert_share(tokens, *experts)
    if not num_prefill:
        return (tokens, 0.0, 0.0, kv_decode, 0.0, 0.0, share, float(num_chunks), 0.0, float(num_rows))
    mixed = num_prefill < num_chunks
    return (tokens, pairs, kv_prefill, 0.0, kv_decode, longest if mixed else 0.0, share, 0.0,
            float(num_chunks) if mixed else 0.0, float(num_rows))


def lm_head_rows(chunks, num_sampled: int, max_decode_len: int = 1,
                 decodes: Decodes | None = None) -> int:
    """Rows of a target pass through the LM head: it scores every verified position, 1 + k
    rows per verifying request (a decode chunk of n tokens adds n − 1 rows to its sampled one)."""
    extra = decodes[0] * (decodes[1] - 1) if decodes is not None else 0
    return num_sampled + extra + sum(n - 1 for n, _ in chunks if n <= max_decode_len)


def step_features(chunks, num_sampled: int, max_decode_len: int = 1,
                  experts: tuple[int, int] = (0, 0), decodes: Decodes | None = None):
    """``features`` of a target pass (``lm_head_rows`` rows)."""
    return features(chunks, lm_head_rows(chunks, num_sampled, max_decode_len, decodes),
                    max_decode_len, experts, decodes)


def pass_time_s(params: dict[str, float], feats) -> float:
    """Seconds of one pass with coefficients ``params`` (see ``PARAMS``) for ``features(...)``."""
    (tokens, pairs, kv_prefill, kv_pure, kv_mixed, longest, share, seqs_pure, seqs_mixed,
     num_rows) = feats
    p, q = params["p"], params["q"]
    linear = (params["w_s"] ** p + (params["a_tok_s"] * tokens) ** p) ** (1 / p)
    work = (params["a_attn_s"] * pairs + params["a_kv_prefill_s"] * kv_prefill
            + params["a_kv_mixed_s"] * kv_mixed)
    attention = (work ** q + (params["a_crit_s"] * longest) ** q) ** (1 / q)
    return (params["t0_s"] + linear + attention + params["a_kv_s"] * kv_pure
            + params["a_moe_s"] * share + params["a_seq_s"] * seqs_pure
            + params["a_seq_mixed_s"] * seqs_mixed + params["a_lm_s"] * num_rows)


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
    for k in ("p", "q"):
        if out[k] < 1:
            raise ConfigError(f"{where}.{k}", f"must be at least 1, got {out[k]!r}")
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
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith("kvsim-cost-profile/"):
        raise ConfigError(where, f"not a kvsim cost profile (expected format {PROFILE_FORMAT!r})")
    if data["format"] != PROFILE_FORMAT:
        raise ConfigError(where, f"profile format {data['format']!r} is older than this kvsim's "
                          f"{PROFILE_FORMAT!r}; re-run kvsim calibrate")
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

    def __init__(self, inp: CostInputs):
        if inp.profile is None:
            raise ConfigError("cost.model", "'fitted' needs cost.profile")
        model, d = inp.model, inp.drafter
        profile = load_profile(inp.profile)
        check_matches(profile, model, inp.tensor_parallel_size, "cost.profile")
        self.target = profile["target"]
        self.drafter: dict[str, float] | None = None
        self.num_draft_passes = 0
        # Chunks of at most 1 + k tokens run on the attention backends' decode path.
        self.max_decode_len = 1 + d.num_passes
        self.experts = (model.num_experts, model.num_experts_per_tok)
        # Profiles time each GPU's kernels; the all-reduces between them come from [hardware].
        self.allreduce = AllReduce(inp)
        self.num_layers = model.num_hidden_layers
        # A profile timed from whole engine steps has the engine's own overhead in its ``t0``.
        self.overhead_s = 0.0 if profile.get("whole_engine_steps") is True else inp.step_overhead_s
        # A profile timed from whole engine steps (``kvsim validate --against vllm-engine``)
        # has the drafter's passes inside its target coefficients.
        drafter_timed = profile.get("draft_in_target") is True
        if d.method not in ("none", "ngram") and not drafter_timed:
            if d.method == "draft_model":
                raise ConfigError("cost.profile", "a fitted profile has no draft-model pass; use the "
                                  "roofline for method = 'draft_model'")
            if profile.get("draft") is None:
                raise ConfigError("cost.profile", f"{inp.profile} has no drafter pass (needed for "
                                  f"speculative method {d.method!r})")
            self.drafter = profile["draft"]
            self.num_draft_passes = d.num_passes
        err = profile.get("heldout_error") or {}
        self.label = (f"fitted ({profile.get('device', '?')}, {inp.profile.stem}, held-out "
                      f"median {err.get('median_pct', float('nan')):.1f} %)")

    def step_time_s(self, chunks, num_sampled: int,
                    decodes: Decodes | None = None) -> float:
        """Seconds for the target model's step over ``chunks`` (pairs ``(n, c)``) and
        ``decodes`` (further chunks as ``Decodes``)."""
        feats = step_features(chunks, num_sampled, self.max_decode_len, self.experts, decodes)
        return (self.overhead_s + pass_time_s(self.target, feats)
                + self.allreduce.time_s(feats[0], self.num_layers))

    def moe_time_s(self, tokens: float, ranks: int = 1) -> float:
        """The profile's routed-expert term, ``a_moe × E(tokens)``, on a ``1/ranks`` share."""
        return self.target["a_moe_s"] * expert_share(tokens, *self.experts) / ranks

    def draft_time_s(self, chunks, num_sampled: int, decodes: Decodes | None = None) -> float:
        """Seconds the drafter adds: one pass over the step's chunks, then k − 1 one-row passes."""
        if self.drafter is None or not num_sampled:
            return 0.0
        (first, rows), (rest, rest_rows) = drafter_passes(chunks, num_sampled, decodes)
        feats = features(first, rows, self.max_decode_len, self.experts, decodes)
        seconds = pass_time_s(self.drafter, feats) + self.allreduce.time_s(feats[0], 1)
        feats = features(rest, rest_rows, 1, self.experts)
        rest_s = pass_time_s(self.drafter, feats) + self.allreduce.time_s(feats[0], 1)
        return seconds + (self.num_draft_passes - 1) * rest_s
