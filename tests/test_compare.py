"""kvsim compare: variants, overrides, verdict, files; one-line errors."""

import csv

import pytest

from kvsim import compare, overrides
from kvsim.cli import main
from kvsim.errors import ConfigError

SCEN = """
[model]
preset = "llama-3.2-1b"
[hardware]
preset = "l40s"
[engine]
num_gpu_blocks = 400
max_model_len = 2048
max_num_batched_tokens = 512
max_num_seqs = 16
[speculative]
method = "eagle"
num_speculative_tokens = 2
[workload]
num_requests = 30
request_rate = 20.0
system_prompt_tokens = 256
num_users = 3
user_history_tokens = 128
input_tokens = 32
output_tokens = 24
"""


@pytest.mark.parametrize("text, expected", [
    ("engine.block_size=16,32", ("engine", "block_size", [16, 32])),
    ("engine.scheduling_policy=fcfs,priority", ("engine", "scheduling_policy", ["fcfs", "priority"])),
    ("speculative.acceptance_rates=[0.8, 0.6],[0.5]", ("speculative", "acceptance_rates",
                                                       [[0.8, 0.6], [0.5]])),
    ("engine.enable_prefix_caching=true", ("engine", "enable_prefix_caching", [True])),
])
def test_override_parsing(text, expected):
    assert overrides.parse(text) == expected


@pytest.mark.parametrize("text", ["engine", "engine.block_size", "block_size=1", "a.b.c=1", "engine.x="])
def test_bad_overrides(text):
    with pytest.raises(ConfigError):
        overrides.parse(text)


def test_default_two_by_two(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(SCEN)
    out = tmp_path / "cmp"
    assert main(["compare", str(tmp_path / "s.toml"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["variant"] for r in rows] == ["neither", "prefix caching", "eagle",
                                            "eagle + prefix caching"]
    # Without prefix caching nothing is ever hit; with it the shared prefixes are.
    assert rows[0]["prefix_cache_hit_rate"] == "" and float(rows[1]["prefix_cache_hit_rate"]) > 0.5
    assert rows[0]["mean_acceptance_length"] == "" and float(rows[2]["mean_acceptance_length"]) > 1
    assert "alone on mean E2E" in printed
    assert (out / "compare.png").stat().st_size > 0
    assert (out / "eagle_prefix_caching" / "requests.csv").exists()


def test_vary_versions(tmp_path):
    (tmp_path / "s.toml").write_text(SCEN)
    out = tmp_path / "cmp"
    assert main(["compare", str(tmp_path / "s.toml"), "--out", str(out), "-q",
                 "--vary", "engine.vllm_version=0.32.0,0.33.0"]) == 0
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["variant"] for r in rows] == ["vllm_version=0.32.0", "vllm_version=0.33.0"]


def test_bad_variant_fails_before_running(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(SCEN)
    out = tmp_path / "cmp"
    assert main(["compare", str(tmp_path / "s.toml"), "--out", str(out),
                 "--vary", "engine.block_size=16,-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error: ") and "engine.block_size" in err and not out.exists()


def _no_method(text: str) -> str:
    return text.replace('method = "eagle"\nnum_speculative_tokens = 2\n', "")


@pytest.mark.parametrize("model, variants, note", [
    # No MTP layers (Llama): EAGLE-3 with 3 drafts. DeepSeek-V3's config.json ships one MTP layer.
    ('preset = "llama-3.2-1b"', ["eagle3", "eagle3 + prefix caching"],
     "comparing eagle3 with 3 drafts (the model has no MTP layers)"),
    ('preset = "deepseek-v3"', ["mtp", "mtp + prefix caching"],
     "comparing mtp with 1 draft (the model's own MTP layers)"),
])
def test_default_comparison_without_a_method_picks_what_the_model_supports(tmp_path, capsys, model,
                                                                           variants, note):
    text = _no_method(SCEN).replace('preset = "llama-3.2-1b"', model)
    if "deepseek" in model:
        text = text.replace('preset = "l40s"', 'preset = "h200"').replace(
            "num_gpu_blocks = 400", "num_gpu_blocks = 400\ntensor_parallel_size = 8")
    (tmp_path / "s.toml").write_text(text)
    assert main(["compare", str(tmp_path / "s.toml"), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "cmp" / "compare.csv").open()))
    assert [r["variant"] for r in rows][2:] == variants
    assert note in printed
    assert "Acceptance: per_position, 0.7 at every position (kvsim's default" in printed


def test_vary_fills_in_the_drafts(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(_no_method(SCEN))
    assert main(["compare", str(tmp_path / "s.toml"), "--out", str(tmp_path / "cmp"),
                 "--vary", "speculative.method=none,eagle3"]) == 0
    assert "num_speculative_tokens not given: eagle3 drafts 3 per step." in capsys.readouterr().out
    resolved = (tmp_path / "cmp" / "method=eagle3" / "scenario.resolved.toml").read_text()
    assert "num_speculative_tokens = 3" in resolved


def test_verdict_says_but_where_the_latencies_disagree():
    rows = [compare.row(n, {"ttft_s": {"p50": t, "p99": t}, "tpot_s": None,
                            "e2e_s": {"mean": e}, "throughput": {"requests_per_s": 1,
                                                                 "output_tokens_per_s": 1},
                            "prefix_cache_hit_rate": None, "cached_tokens_mean": 0,
                            "num_preemptions": 0, "stopped_by": None, "num_finished": 1,
                            "num_requests": 1})
            for n, t, e in (("neither", 0.05, 3.0), ("prefix caching", 0.02, 2.0),
                            ("mtp", 0.04, 1.5), ("mtp + prefix caching", 0.025, 1.0))]
    lines = compare.verdict(rows, default=True)
    # vs prefix caching: E2E -50 %, TTFT p50 +25 %: "but". vs mtp: both lower: "and".
    assert lines[0] == ("mtp + prefix caching beats prefix caching alone on mean E2E: 1.000 s vs "
                        "2.000 s (-50.0 %), but TTFT p50 25.0 vs 20.0 ms (+25.0 %).")
    assert ", and TTFT p50 25.0 vs 40.0 ms (-37.5 %)." in lines[1]


def test_a_run_cut_short_is_named_and_left_out_of_the_verdict():
    from kvsim import compare as cmp
    base = {"ttft_p50_ms": 1.0, "stopped_by": None, "stop_detail": None, "num_finished": 40,
            "num_requests": 40, "mean_cached_tokens": 0}
    rows = [{**base, "variant": "a", "e2e_mean_s": 0.4, "stopped_by": "engine_dead",
             "stop_detail": "ValueError: Cannot get 1 free blocks from the pool", "num_finished": 27},
            {**base, "variant": "b", "e2e_mean_s": 0.6}]
    assert cmp.verdict(rows, default=False) == [
        "a: vLLM's engine core dies (ValueError: Cannot get 1 free blocks from the pool) after 27 "
        "of 40 requests finished; its figures cover those only, and it is left out of the "
        "comparison.", "Lowest mean E2E latency: b (0.600 s)."]
    # The 2x2's sentences need all four runs whole.
    four = [{**base, "variant": v, "e2e_mean_s": 1.0} for v in "wxyz"]
    four[3] = {**four[3], "stopped_by": "max_steps", "num_finished": 3}
    assert cmp.verdict(four, default=True)[0].startswith("z: run.max_steps cut the run after 3 of 40")
