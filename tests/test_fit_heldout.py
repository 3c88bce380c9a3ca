"""The fitted form's held-out and off-slice error, scored as the benchmark scores it.

Issue 38: ``benchmarks/cost_modes.py`` printed a held-out median of 4,638-29,657 % for the
fitted form while the fit itself was fine: it built the fitted form's decodes as the old
4-tuple (count, Σ(c + n), max, min) after ``Decodes`` became (count, n, Σ(c + n), max, min),
so the run-time features read the decodes' KV sum as their tokens each. Here step times come
from a physical roofline written out below (not from kvsim), the form is fitted to one slice of
a grid and scored off it by the run-time paths (``FittedCost``'s features, ``GridStep.fitted_s``
and the benchmark's own ``llmservingsim.heldout_errors`` / ``offslice_errors``).

The bound. The truth is the form's own family at knee sharpness p = q = ∞: every term is a
non-negative coefficient times one of the form's features, and the two maxima (weights vs
FLOPs; attention work vs a long sequence's critical path) are hard. The fit bounds the knees to
p, q <= 32, where the smooth maximum (a^p + b^p)^(1/p) lies between max(a, b) and 2^(1/p)
max(a, b). So the true coefficients at p = q = 32 miss by at most 2^(1/32) - 1 = 2.2 % at every
point, on the slice or off it: a fit as good as the family allows misses by no more off the
slice than that, plus what the optimiser leaves (its tolerance, the soft-L1 loss trading a
few knee points). So the worst off-slice point must be within the smoothing bound, 2.2 % (the
fit gives 1.0 %), and the median within 0.5 %: most points sit far from both knees, where a
p = 32 smooth maximum is the hard one to within (1/2)^32 and what is left is the optimiser's
tolerance (the fit gives 0.03 %). A scoring path whose features disagree with the fit's misses
by orders of magnitude (issue 38's medians of 4,638-29,657 %).
"""

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from builders import SHARED_DATA

from kvsim.calibrate import fit, llmservingsim
from kvsim.cost import fitted
from kvsim.cost.interpolated import LayerProfile

SMOOTHING = 2 ** (1 / 32) - 1  # the most a p = 32 smooth max overestimates a hard max: 2.2 %
MAX_BOUND = SMOOTHING  # the worst off-slice point
MEDIAN_BOUND = 0.005

# A Llama-3.1-8B-like model (8e9 parameters in bf16, 32 layers, 32 query and 8 KV heads of 128)
# on a GPU of 1.8 TB/s and 400 TFLOP/s.
BW, FLOPS, LAYERS = 1.8e12, 4e14, 32
KV_ENTRY_BYTES = 2 * 8 * 128 * 2 * LAYERS  # K and V, 8 heads of 128, bf16, every layer
TRUE = {
    "t0": 20e-6,  # launch and per-step work
    "w": 16e9 / BW,  # weights read once: 8.9 ms
    "a_tok": 2 * 8e9 / FLOPS,  # 2 FLOPs per parameter per token: 40 µs (knee at 222 tokens)
    "a_attn": 4 * 32 * 128 * LAYERS / FLOPS,  # QK and PV per causal pair: 1.3 ns
    "a_kv_prefill": KV_ENTRY_BYTES / BW,  # KV read per entry: 73 ns
    "a_kv": KV_ENTRY_BYTES / BW,  # the decode kernel reads KV at full bandwidth ...
    "a_kv_mixed": 2 * KV_ENTRY_BYTES / BW,  # ... the prefill kernel half as fast
    "a_crit": 6e-7,  # one long sequence walked by few thread blocks, per token
    "a_seq": 2e-6, "a_seq_mixed": 15e-6,  # per sequence (pure decode, mixed)
    "a_lm": 4e-6,  # LM head and sampler per row
}


def roofline_s(pc: int, kp: int, nd: int, kd: int, c: dict = TRUE) -> float:
    """Seconds of one pass: a prefill chunk of ``pc`` tokens after ``kp`` beside ``nd`` decodes
    after ``kd`` each, one LM-head row per sequence: hard maxima, no kvsim code."""
    tokens, rows = pc + nd, nd + (pc > 0)
    t = c["t0"] + max(c["w"], c["a_tok"] * tokens) + c["a_lm"] * rows
    kv_decode = nd * (kd + 1)
    if not pc:
        return t + c["a_kv"] * kv_decode + c["a_seq"] * nd
    work = (c["a_attn"] * pc * (kp + (pc + 1) / 2) + c["a_kv_prefill"] * (kp + pc)
            + c["a_kv_mixed"] * kv_decode)
    if not nd:
        return t + work
    return t + max(work, c["a_crit"] * max(kp + pc, kd + 1)) + c["a_seq_mixed"] * (1 + nd)


GRID = {"pc": (0, 16, 64, 128, 256, 512, 1024, 2048), "kp": (0, 512, 2048, 4096, 16384),
        "nd": (0, 1, 4, 16, 64, 256), "kd": (16, 512, 2048, 4096, 16384)}


def grid_points():
    for pc, kp, nd, kd in itertools.product(*GRID.values()):
        if (pc == 0 and kp) or (nd == 0 and kd != GRID["kd"][0]) or pc + nd == 0:
            continue
        yield pc, kp, nd, (kd if nd else 0)


def in_slice(pc, kp, nd, kd, tokens=512, context=4096):
    return pc + nd <= tokens and kp <= context and kd <= context


def csv_row(pc, kp, nd, kd, seconds):
    """A composed row as ``kvsim calibrate`` reads it (``llmservingsim.step_rows``' columns)."""
    return {"pass": "target", "num_prefill_tokens": pc, "prefill_context": kp, "num_decode_seqs": nd,
            "decode_query_len": 1, "decode_context": kd, "num_sampled": nd + (pc > 0),
            "step_s": repr(seconds)}


def test_roofline_truth_is_in_the_form_at_sharp_knees():
    # The bound's premise: the form with the true coefficients and p = q = 32 is within the
    # smoothing bound of the hard roofline everywhere (and overestimates, never under).
    params = {"t0_s": TRUE["t0"], "w_s": TRUE["w"], "p": 32.0, "a_tok_s": TRUE["a_tok"],
              "a_attn_s": TRUE["a_attn"], "a_kv_prefill_s": TRUE["a_kv_prefill"], "a_kv_s": TRUE["a_kv"],
              "a_kv_mixed_s": TRUE["a_kv_mixed"], "a_crit_s": TRUE["a_crit"], "q": 32.0, "a_moe_s": 0.0,
              "a_seq_s": TRUE["a_seq"], "a_seq_mixed_s": TRUE["a_seq_mixed"], "a_lm_s": TRUE["a_lm"]}
    for pc, kp, nd, kd in grid_points():
        ratio = LayerProfile.grid_step(pc, kp, nd, kd).fitted_s(params, (0, 0)) / roofline_s(pc, kp, nd, kd)
        assert 1 - 1e-12 <= ratio <= 1 + SMOOTHING + 1e-12


def test_fit_on_a_slice_extrapolates_off_it_by_the_run_time_paths():
    points = list(grid_points())
    on = [p for p in points if in_slice(*p)]
    off = [p for p in points if not in_slice(*p)]
    assert len(on) > 300 and len(off) > 500  # past the slice: 4x the tokens, 4x the context
    rows = [csv_row(*p, roofline_s(*p)) for p in on]
    params, held, _, _ = fit.fit_rows(rows, "synthetic", 0)["target"]
    assert held["median_pct"] < 100 * MEDIAN_BOUND and held["max_pct"] < 100 * MAX_BOUND
    x = np.array([params[k] for k in fit.PARAMS])
    col = fit._columns([csv_row(*p, roofline_s(*p)) for p in off], "synthetic")
    by_fit = fit.predict(x, fit.feature_matrix(col))  # the fit's own (CSV) features
    errors = []
    for (pc, kp, nd, kd), fit_s in zip(off, by_fit, strict=True):
        truth = roofline_s(pc, kp, nd, kd)
        # FittedCost's path: chunks and Decodes (count, n, Σ(c + n), max, min) ...
        decodes = (nd, 1, nd * (kd + 1.0), kd + 1.0, kd + 1.0) if nd else None
        chunks = [(pc, kp)] if pc else []
        cost_s = fitted.pass_time_s(params, fitted.step_features(chunks, nd + (pc > 0), 1, (0, 0), decodes))
        # ... and the interpolated model's (and the benchmark's) past its grid: GridStep.fitted_s
        grid_s = LayerProfile.grid_step(pc, kp, nd, kd).fitted_s(params, (0, 0))
        assert cost_s == pytest.approx(fit_s, rel=1e-9) and grid_s == pytest.approx(fit_s, rel=1e-9)
        errors.append(abs(grid_s / truth - 1))
    assert np.median(errors) < MEDIAN_BOUND and max(errors) < MAX_BOUND


# -- the benchmark's scorer on a synthetic layer-profile folder --------------------------------

MODEL_LAYERS = 16  # llama-3.2-1b, the preset of the folder's model
PER_LAYER = {"qkv_proj": 6.0, "o_proj": 3.0, "down_proj": 5.0, "act_fn": 1.0, "rotary_emb": 1.0,
             "layernorm": 1.0}  # µs, flat in tokens
ONCE = {"embedding": 2.0, "final_layernorm": 1.0}
GATE_UP = (150.0, 0.9)  # µs: weights read, per token (a roofline: knee at 167 tokens)
HEAD = {"lm_head": (30.0, 2.0), "sampler": (10.0, 1.0)}  # µs: fixed, per sequence
# Per layer, µs (the pass multiplies by the layers): per KV entry, per causal pair, ...
ATT = {"c": 4.0, "kv": 0.002, "kv_mixed": 0.004, "kv_prefill": 0.002, "pair": 4e-5, "crit": 0.02,
       "seq": 0.5, "seq_mixed": 1.0}


def attention_us(pc, kp, nd, kd):
    kv_decode = nd * (kd + 1)
    if not pc:
        return ATT["c"] + ATT["kv"] * kv_decode + ATT["seq"] * nd
    work = (ATT["pair"] * pc * (kp + (pc + 1) / 2) + ATT["kv_prefill"] * (kp + pc)
            + ATT["kv_mixed"] * kv_decode)
    if not nd:
        return ATT["c"] + work
    return ATT["c"] + max(work, ATT["crit"] * max(kp + pc, kd + 1)) + ATT["seq_mixed"] * (1 + nd)


def profile_us(pc, kp, nd, kd):
    """The composed target pass (``LayerProfile.pass_us``'s documented composition), by hand."""
    tokens, rows = pc + nd, nd + (pc > 0)
    per_layer = (attention_us(pc, kp, nd, kd) + sum(PER_LAYER.values()) + PER_LAYER["layernorm"]
                 + max(GATE_UP[0], GATE_UP[1] * tokens))
    return MODEL_LAYERS * per_layer + sum(ONCE.values()) + sum(a + b * rows for a, b in HEAD.values())


def write_profile(folder):
    sub = folder / "tp1"
    sub.mkdir(parents=True)
    lines = ["prefill_chunk,kv_prefill,n_decode,kv_decode,time_us"]
    lines += [f"{pc},{kp},{nd},{kd},{attention_us(pc, kp, nd, kd)!r}" for pc, kp, nd, kd in grid_points()]
    (sub / "attention.csv").write_text("\n".join(lines) + "\n")
    most = GRID["pc"][-1] + GRID["nd"][-1]
    dense = ["layer,tokens,time_us"]
    dense += [f"{op},{t},{us!r}" for op, us in {**PER_LAYER, **ONCE}.items() for t in (1, most)]
    dense += [f"gate_up_proj,{t},{max(GATE_UP[0], GATE_UP[1] * t)!r}" for t in range(1, most + 1)]
    (sub / "dense.csv").write_text("\n".join(dense) + "\n")
    (sub / "per_sequence.csv").write_text("layer,sequences,time_us\n" + "".join(
        f"{op},{s},{a + b * s!r}\n" for op, (a, b) in HEAD.items() for s in (1, 512)))
    (folder / "meta.yaml").write_text("model: meta-llama/Llama-3.2-1B\ngpu: Synthetic GPU\n"
                                      "vllm_version: 0.19.0\nvariant: bf16\ntp_degrees: [1]\n")
    return folder


def test_benchmark_scorer_on_a_roofline_profile(tmp_path):
    from kvsim.config import model_preset

    folder = write_profile(tmp_path / "p")
    assert model_preset("llama-3.2-1b").num_hidden_layers == MODEL_LAYERS
    layers = LayerProfile(folder, 1, model_preset("llama-3.2-1b"))
    for point in [(0, 0, 1, 16), (16, 0, 256, 16384), (2048, 16384, 0, 0), (128, 512, 4, 2048)]:
        step = layers.grid_step(*point)
        assert layers.pass_us(step, MODEL_LAYERS) == pytest.approx(profile_us(*point), rel=1e-12)
    held = llmservingsim.heldout_errors(folder, 1)
    assert held["n"] == len(list(grid_points())) // 5
    e = np.abs(held["fitted"])
    assert np.median(e) < MEDIAN_BOUND and e.max() < MAX_BOUND
    # (the interpolation, across left-out points of a sparse grid with hard maxima, is exact at
    # the median and misses by up to 3x at the worst: not what this test is about)
    assert np.median(np.abs(held["interpolated"])) < 0.01
    off = llmservingsim.offslice_errors(folder, 1, 512, 4096)
    assert off["n"] == sum(not in_slice(*p) for p in grid_points())
    e = np.abs(off["fitted"])
    assert np.median(e) < MEDIAN_BOUND and e.max() < MAX_BOUND


def test_the_benchmark_prints_the_scorer(tmp_path):
    # benchmarks/cost_modes.py itself (a script, loaded by path): its held-out row is the
    # scorer's, in percent
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cost_modes.py"
    spec = importlib.util.spec_from_file_location("cost_modes", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.heldout(write_profile(tmp_path / "p"), 1)
    assert res["n"] == len(list(grid_points())) // 5
    median, p90, worst = res["fitted"]
    assert median < 100 * MEDIAN_BOUND and worst < 100 * MAX_BOUND
    assert res["interpolated"][0] < 1


# -- the benchmark's figure on LLMServingSim's measured tables -----------------------------------

LLAMA = SHARED_DATA / "llmservingsim" / "profiles" / "RTXPRO6000" / "meta-llama" / "Llama-3.1-8B" / "bf16"


@pytest.mark.skipif(not LLAMA.is_dir(), reason="no ../shared/data/llmservingsim here")
def test_heldout_error_on_measured_profiles():
    # What benchmarks/cost_modes.py prints for this folder (calibration/README.md's table):
    # interpolated 0.3 / 5.2 % and fitted 3.0 / 11.9 % (median / p90) on 3,661 held-out grid
    # points; off the slice of <= 1,024 tokens and 8,192 context, fitted 4.3 / 23.1 %. The
    # bounds leave room for a refit that moves a point or two, not for a broken form or
    # scoring (issue 38 printed a fitted median of 28,467 % here): a median under 5 % is what
    # the README's 1.5-3.0 % medians claim, p90 under 20 %; off the slice, median under 8 %.
    held = llmservingsim.heldout_errors(LLAMA, 1)
    assert held["n"] == 3661
    fit_e, interp_e = np.abs(held["fitted"]), np.abs(held["interpolated"])
    assert np.median(fit_e) < 0.05 and np.percentile(fit_e, 90) < 0.20 and fit_e.max() < 1.0
    assert np.median(interp_e) < 0.01 and np.percentile(interp_e, 90) < 0.10
    off = np.abs(llmservingsim.offslice_errors(LLAMA, 1, 1024, 8192)["fitted"])
    assert np.median(off) < 0.08 and np.percentile(off, 90) < 0.35 and off.max() < 1.0
    assert math.isfinite(off.max())
