"""kvsim compare: variants, overrides, verdict, files; one-line errors."""

import csv

import pytest

from kvsim import overrides
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
    assert "alone: mean E2E" in printed
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


def test_default_needs_a_method(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(SCEN.replace('method = "eagle"', 'method = "none"'))
    assert main(["compare", str(tmp_path / "s.toml"), "--out", str(tmp_path / "c")]) == 2
    assert "speculative.method" in capsys.readouterr().err
