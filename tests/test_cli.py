"""The command line: results on disk, one-line errors, determinism."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.results import RESULT_FILES

ROOT = Path(__file__).resolve().parents[1]

SMALL = """
[model]
preset = "llama-3.2-1b"
[hardware]
preset = "l40s"
[engine]
num_gpu_blocks = 200
max_model_len = 2048
max_num_batched_tokens = 512
max_num_seqs = 16
[workload]
num_requests = 60
request_rate = 40.0
system_prompt_tokens = 96
num_users = 4
user_history_tokens = 200
input_tokens = 40
output_tokens = 200
[run]
seed = 7
"""


def run_small(tmp_path, name="out", text=SMALL):
    scen = tmp_path / "s.toml"
    scen.write_text(text)
    out = tmp_path / name
    assert main(["run", str(scen), "--out", str(out), "--quiet"]) == 0
    return out


def test_run_writes_the_result_files(tmp_path):
    out = run_small(tmp_path)
    assert sorted(p.name for p in out.iterdir()) == sorted(RESULT_FILES)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_finished"] == summary["num_requests"] == 60
    lines = (out / "requests.csv").read_text().splitlines()
    assert lines[0].split(",")[:5] == ["req_id", "arrival_s", "prompt_tokens", "output_tokens",
                                        "cached_tokens"]
    assert len(lines) == 61
    # The counters equal the sums of their per-step records and of per-request lookups.
    steps = (out / "steps.csv").read_text().splitlines()
    header = steps[0].split(",")
    q = sum(int(r.split(",")[header.index("prefix_cache_queries")]) for r in steps[1:])
    assert q == summary["prefix_cache_queries"] == 60 * 336
    assert summary["num_preemptions"] > 0  # 200 blocks is tight for this load


def test_same_seed_same_bytes(tmp_path):
    a, b = run_small(tmp_path, "a"), run_small(tmp_path, "b")
    for f in RESULT_FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    c = run_small(tmp_path, "c", SMALL.replace("seed = 7", "seed = 8"))
    assert (a / "requests.csv").read_bytes() != (c / "requests.csv").read_bytes()


def test_resolved_scenario_reproduces_the_run(tmp_path):
    a = run_small(tmp_path, "a")
    out = tmp_path / "again"
    assert main(["run", str(a / "scenario.resolved.toml"), "--out", str(out), "--quiet"]) == 0
    for f in ("requests.csv", "steps.csv"):
        assert (a / f).read_bytes() == (out / f).read_bytes()


@pytest.mark.parametrize("text, where", [
    (SMALL.replace("block_size", "x").replace("num_gpu_blocks", "num_gpu_block"), "engine.num_gpu_block"),
    (SMALL.replace("seed = 7", "seed = -1"), "run.seed"),
    (SMALL + "\n[[bad", "not valid TOML"),
])
def test_bad_scenario_one_line_exit_2_no_output(tmp_path, capsys, text, where):
    scen = tmp_path / "s.toml"
    scen.write_text(text)
    out = tmp_path / "out"
    assert main(["run", str(scen), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvsim: error: ") and where in err
    assert not out.exists() and list(tmp_path.iterdir()) == [scen]


def test_missing_scenario_file(capsys, tmp_path):
    assert main(["run", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_refuses_to_overwrite_a_non_result_folder(tmp_path, capsys):
    scen = tmp_path / "s.toml"
    scen.write_text(SMALL)
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep")
    assert main(["run", str(scen), "--out", str(tmp_path / "precious")]) == 2
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep"


def test_console_script_prints_summary_without_traceback(tmp_path):
    out = run_small(tmp_path)  # warm nothing; just make sure the module path works too
    proc = subprocess.run([sys.executable, "-m", "kvsim.cli", "run", str(tmp_path / "s.toml"),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "prefix cache" in proc.stdout and "TTFT" in proc.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1]}\n{"arrival_s": 0}\n')
    scen = tmp_path / "t.toml"
    scen.write_text(SMALL.split("[workload]")[0] + '[workload]\nkind = "trace"\npath = "bad.jsonl"\n')
    proc = subprocess.run([sys.executable, "-m", "kvsim.cli", "run", str(scen)], capture_output=True,
                          text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"kvsim: error: {bad}:2: max_tokens must be an integer >= 1, got None"
    assert not (tmp_path / "kvsim-out").exists()
