"""The interpolated cost model (``kvsim.cost.interpolated``) on synthetic layer profiles whose
tables are linear in every axis: what a pass costs is computed here by hand from the tables'
formulas (``tests/builders.py``), not read back from kvsim."""

import math

import pytest
from builders import (
    ATTENTION_GRID,
    DENSE_OPS,
    HEAD_OPS,
    synthetic_attention_us,
    synthetic_layer_profile,
    synthetic_moe_us,
)

from kvsim.assemble import cost_inputs
from kvsim.cli import main
from kvsim.config import model_preset, parse_scenario
from kvsim.cost import COST_MODELS
from kvsim.cost.fitted import expert_share
from kvsim.cost.interpolated import GridStep, LayerProfile

MODEL = model_preset("llama-3.2-1b")
PER_LAYER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "act_fn", "rotary_emb", "layernorm")


def dense_us(ops, t):
    return sum(DENSE_OPS[op][0] + DENSE_OPS[op][1] * t for op in ops)


def head_us(s):
    return sum(a + b * s for a, b in HEAD_OPS.values())


def by_hand_us(prefills, decodes, layers):
    """A pass by the module's documented composition, from the synthetic formulas: decodes at
    their mean context (before their own token), the first prefill chunk with them, each
    further chunk alone less the least attention time profiled (one decode at context 64:
    5 µs + 0.1 µs + 0.0002 µs × 64)."""
    nd = len(decodes)
    kd = sum(decodes) / nd if nd else 0.0
    (pc, kp), *rest = prefills or [(0, 0)]
    floor = synthetic_attention_us(0, 0, 1, 64)
    attention = synthetic_attention_us(pc, kp, nd, kd) + sum(
        synthetic_attention_us(n, c, 0, 0) - floor for n, c in rest)
    tokens = sum(n for n, _ in prefills) + nd
    per_layer = attention + dense_us(PER_LAYER, tokens) + dense_us(["layernorm"], tokens)
    rows = nd + len(prefills)
    return layers * per_layer + dense_us(["embedding", "final_layernorm"], tokens) + head_us(rows)


@pytest.fixture
def layers(tmp_path):
    return LayerProfile(synthetic_layer_profile(tmp_path / "p"), 1, MODEL)


def test_attention_is_the_multilinear_table_anywhere_in_the_grid(layers):
    for point in [(100, 500, 10, 700), (16, 0, 1, 64), (1024, 4096, 64, 4096), (300, 0, 0, 0),
                  (0, 0, 3, 100), (40, 2000, 33, 3000)]:
        assert layers.attention_us(*point) == pytest.approx(synthetic_attention_us(*point), rel=1e-12)


def test_a_pass_composes_the_layer_tables(layers):
    L = MODEL.num_hidden_layers
    cases = [([(300, 700)], [100, 2000, 37]),  # a prefill chunk beside three decodes
             ([], [64, 64, 4000, 900]),  # decodes alone
             ([(500, 0), (200, 1000), (90, 30)], [1500])]  # three prefill chunks
    for prefills, contexts in cases:
        chunks = [*prefills, *[(1, c) for c in contexts]]
        step = GridStep.of(chunks, len(contexts) + len(prefills), 1)
        assert layers.pass_us(step, L) == pytest.approx(by_hand_us(prefills, contexts, L), rel=1e-12)


def test_past_the_grid_the_fitted_form_extrapolates_from_its_edge(tmp_path):
    sc = parse_scenario(_scenario(synthetic_layer_profile(tmp_path / "p")))
    cost = COST_MODELS["interpolated"](cost_inputs(sc))
    edge = ATTENTION_GRID["kd"][-1]
    # 8 decodes at twice the profiled context: the step at the edge, scaled by the fitted
    # form's own ratio between the two (a step inside the grid is the table's, exactly).
    inside = [(1, edge)] * 8
    outside = [(1, 2 * edge)] * 8
    t_edge = cost.step_time_s(inside, 8)
    assert t_edge == pytest.approx(1e-6 * by_hand_us([], [edge] * 8, MODEL.num_hidden_layers))
    fitted = cost.fit_target
    ratio = (GridStep.of(outside, 8, 1).fitted_s(fitted, (0, 0))
             / GridStep.of(inside, 8, 1).fitted_s(fitted, (0, 0)))
    assert ratio > 1.05  # the longer context reads more KV
    assert cost.step_time_s(outside, 8) == pytest.approx(t_edge * ratio, rel=1e-12)


def test_skewed_decode_contexts_move_toward_the_longest_by_the_bucket_alpha(tmp_path):
    # Four decodes at contexts 100, 100, 100, 3000 (mean 825, skew rate 725 / 2900 = 0.25,
    # longest 3000 > 1k, no prefill): bucket (0, n<=8, sr<=50%, kvB>1k, kp=0) has alpha 0.2.
    key = (0, "n<=8", "sr<=50%", "kvB>1k", "kp=0")
    folder = synthetic_layer_profile(tmp_path / "p", skew={key: 0.2})
    layers = LayerProfile(folder, 1, MODEL)
    contexts = [100, 100, 100, 3000]
    step = GridStep.of([(1, c) for c in contexts], 4, 1)
    t_mean = synthetic_attention_us(0, 0, 4, 825)
    t_max = synthetic_attention_us(0, 0, 4, 3000)
    assert layers.decode_attention_us(0, 0, step) == pytest.approx(t_mean + 0.2 * (t_max - t_mean))
    # Another bucket falls back to alpha_default (0.05): 40 decodes, one long.
    contexts = [200] * 39 + [4000]
    step = GridStep.of([(1, c) for c in contexts], 40, 1)
    mean = sum(contexts) / 40
    t_mean, t_max = synthetic_attention_us(0, 0, 40, mean), synthetic_attention_us(0, 0, 40, 4000)
    assert layers.decode_attention_us(0, 0, step) == pytest.approx(t_mean + 0.05 * (t_max - t_mean))
    # Equal contexts: no correction.
    step = GridStep.of([(1, 500)] * 4, 4, 1)
    assert layers.decode_attention_us(0, 0, step) == pytest.approx(synthetic_attention_us(0, 0, 4, 500))


def test_expert_parallel_ranks_run_their_share_of_the_experts(tmp_path):
    qwen = model_preset("qwen3-30b-a3b")
    folder = synthetic_layer_profile(tmp_path / "p", hf_model="Qwen/Qwen3-30B-A3B", moe=True)
    layers = LayerProfile(folder, 1, qwen)
    n, k = qwen.num_experts, qwen.num_experts_per_tok
    for tokens in (16, 200, 1000):
        experts = n * expert_share(tokens, n, k)
        assert layers.moe_us(tokens) == pytest.approx(synthetic_moe_us(tokens, experts))
        # two ranks: half the routed rows on half the activated experts, each
        assert layers.moe_us(tokens, 2) == pytest.approx(synthetic_moe_us(tokens / 2, experts / 2))


def test_lazy_decode_sums_cost_what_their_chunks_cost(tmp_path):
    sc = parse_scenario(_scenario(synthetic_layer_profile(tmp_path / "p")))
    cost = COST_MODELS["interpolated"](cost_inputs(sc))
    contexts = [5, 900, 77, 3000, 12_000]
    sums = (5, 1, sum(c + 1 for c in contexts), max(contexts) + 1, min(contexts) + 1)
    for prefills in ([], [(300, 40)], [(700, 0), (2000, 9000)]):
        listed = cost.step_time_s([*prefills, *[(1, c) for c in contexts]], 5 + len(prefills))
        assert cost.step_time_s(prefills, 5 + len(prefills), sums) == listed


def _scenario(folder, **cost):
    return {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
            "cost": {"layer_profile": str(folder), **cost}, "workload": {"num_requests": 20}}


def test_a_scenario_runs_on_layer_profiles_and_bad_ones_are_one_line(tmp_path, capsys):
    folder = synthetic_layer_profile(tmp_path / "p")
    sc = parse_scenario(_scenario(folder))
    assert (sc.cost.model, sc.cost.step_overhead_s) == ("interpolated", 0.0)
    toml = tmp_path / "s.toml"
    toml.write_text('[model]\npreset = "llama-3.2-1b"\n[hardware]\npreset = "l40s"\n[cost]\n'
                    'layer_profile = "p"\n[workload]\nnum_requests = 20\n')
    assert main(["run", str(toml), "--out", str(tmp_path / "o")]) == 0
    assert "cost model: interpolated (Synthetic GPU, vLLM 0.19.0 layer profiles" in capsys.readouterr().out
    bad = [("layer_profile = \"nowhere\"", "cost.layer_profile: no folder"),
           ("layer_profile = \"p\"\n[engine]\ntensor_parallel_size = 2",
            "has no tp2/ (tensor_parallel_size 2; profiled: 1)"),
           ("model = \"interpolated\"", "'interpolated' needs cost.layer_profile"),
           ("model = \"roofline\"\nlayer_profile = \"p\"", "is used only with cost.model = 'interpolated'")]
    for text, message in bad:
        toml.write_text(f'[model]\npreset = "llama-3.2-1b"\n[hardware]\npreset = "l40s"\n'
                        f'[cost]\n{text}\n')
        assert main(["run", str(toml), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (text, err)
        assert not (tmp_path / "x").exists()
    # A profile of another model's shape is refused, naming both.
    other = synthetic_layer_profile(tmp_path / "q", hf_model="meta-llama/Llama-3.1-8B")
    toml.write_text(f'[model]\npreset = "llama-3.2-1b"\n[hardware]\npreset = "l40s"\n[cost]\n'
                    f'layer_profile = "{other.name}"\n')
    assert main(["run", str(toml), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "profile is for model 'llama-3.1-8b', not 'llama-3.2-1b'" in err
    # A table with a bad value names its line.
    (folder / "tp1" / "dense.csv").write_text("layer,tokens,time_us\nqkv_proj,1,fast\n")
    toml.write_text('[model]\npreset = "llama-3.2-1b"\n[hardware]\npreset = "l40s"\n[cost]\n'
                    'layer_profile = "p"\n')
    assert main(["run", str(toml), "--out", str(tmp_path / "x")]) == 2
    assert "dense.csv:2: expected numbers in tokens, time_us" in capsys.readouterr().err
    assert math.isfinite(sc.cost.step_overhead_s)
