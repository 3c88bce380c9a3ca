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
                           "--out", str(out), "--force"], capture_output=True, text=True, cwd=ROOT)
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


def _kvsim(*args, cwd=ROOT, **kw):
    return subprocess.run([sys.executable, "-m", "kvsim.cli", *args], capture_output=True,
                          text=True, cwd=cwd, **kw)


def _one_error_line(proc, where: str, what: str) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith(f"kvsim: error: {where}") and what in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", ["run", "compare", "sweep"])
def test_a_binary_scenario_is_one_line(tmp_path, command):
    (tmp_path / "bin.toml").write_bytes(bytes(range(256)) * 4)
    proc = _kvsim(command, str(tmp_path / "bin.toml"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "UTF-8" in proc.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("section, key, value, what", [
    ("workload", "num_requests", 2**63 - 1, "must be at most 2,000,000"),
    ("engine", "num_gpu_blocks", 10**12, "must be at most 4,194,304"),
    # A pool derived from memory is bounded too: 100 TB of KV cache.
    ("engine", "kv_cache_memory_bytes", 10**14, "more than kvsim holds (4,194,304)"),
])
def test_sizes_are_bounded_before_anything_is_built(tmp_path, section, key, value, what):
    raw = SMALL.replace("num_gpu_blocks = 200\n", "")
    raw = raw.replace(f"[{section}]\n", f"[{section}]\n{key} = {value}\n")
    raw = raw.replace("num_requests = 60\n", "") if key == "num_requests" else raw
    (tmp_path / "s.toml").write_text(raw)
    proc = _kvsim("run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), timeout=60)
    where = "s.toml: engine.num_gpu_blocks" if key != "num_requests" else f"s.toml: workload.{key}"
    _one_error_line(proc, where, what)
    assert not (tmp_path / "o").exists()


def test_a_closed_pipe_is_no_traceback():
    for args in (["presets"], ["traces"]):
        proc = subprocess.run(f"{sys.executable} -m kvsim.cli {' '.join(args)} | head -1",
                              shell=True, capture_output=True, text=True, cwd=ROOT)
        assert proc.stdout.count("\n") == 1 and proc.stderr == "", proc.stderr


def test_out_on_an_earlier_result_needs_force(tmp_path):
    out = run_small(tmp_path)
    before = (out / "summary.json").read_text()
    proc = _kvsim("run", str(tmp_path / "s.toml"), "--out", str(out))
    _one_error_line(proc, str(out), "holds an earlier kvsim result; give --force to replace it")
    assert (out / "summary.json").read_text() == before
    assert _kvsim("run", str(tmp_path / "s.toml"), "--out", str(out), "--force", "-q").returncode == 0
    # A sweep's folder, and a file where a folder should be, are named as what they are.
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "sweep.json").write_text("{}")
    _one_error_line(_kvsim("run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "sw")),
                    str(tmp_path / "sw"), "holds a kvsim sweep")
    (tmp_path / "file.txt").write_text("x")
    _one_error_line(_kvsim("compare", str(tmp_path / "s.toml"), "--out", str(tmp_path / "file.txt" / "sub")),
                    str(tmp_path / "file.txt" / "sub"), f"{tmp_path / 'file.txt'} is a file, not a folder")


def test_an_unwritable_sweep_folder_is_one_line(tmp_path):
    (tmp_path / "s.toml").write_text(SMALL)
    proc = _kvsim("sweep", str(tmp_path / "s.toml"), "--grid", "engine.max_num_seqs=8,16", "-q",
                  "--out", "/proc/kvsim-cannot-write-here")
    _one_error_line(proc, "/proc/kvsim-cannot-write-here", "")


def test_sigterm_leaves_no_folder(tmp_path):
    import signal
    import time

    (tmp_path / "s.toml").write_text(SMALL.replace("num_requests = 60", "num_requests = 200000"))
    proc = subprocess.Popen([sys.executable, "-m", "kvsim.cli", "run", str(tmp_path / "s.toml"),
                             "--out", str(tmp_path / "o"), "-q"], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not any(tmp_path.glob("o.partial-*")):  # the run is writing its folder
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert proc.stderr.read().strip() == "kvsim: terminated"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


def test_summary_latencies_are_the_request_rows(tmp_path):
    # summary.json's TTFT / TPOT / E2E are the distributions of requests.csv's columns.
    import csv
    import statistics

    out = run_small(tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    rows = list(csv.DictReader((out / "requests.csv").open()))
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        values = [float(r[key]) for r in rows if r[key]]
        assert summary[key]["mean"] == pytest.approx(statistics.fmean(values), rel=1e-7), key
        assert summary[key]["p50"] == pytest.approx(statistics.median(values), rel=1e-7), key
    for r in rows:
        assert float(r["queue_s"]) + float(r["prefill_s"]) == pytest.approx(float(r["ttft_s"]))


def test_over_capacity_and_time_units():
    from kvsim.metrics import over_capacity, time_unit

    # 20 requests: queues 0.1 s in the first quarter, 3 s in the last: the engine falls behind.
    growing = [0.1] * 5 + [1.0] * 10 + [3.0] * 5
    assert over_capacity(growing) == {"first_quarter_queue_s": 0.1, "last_quarter_queue_s": 3.0}
    assert over_capacity([0.5] * 20) is None  # steady waits
    assert over_capacity([0.0] * 15 + [0.9] * 5) is None  # under a second
    assert over_capacity([3.0] * 8) is None  # too few requests to say
    assert time_unit(0.11) == ("ms", 1e3) and time_unit(42.0) == ("s", 1.0)
    assert time_unit(2693.0) == ("min", 1 / 60) and time_unit(2.98, "s") == ("s", 1.0)


def _window_chat(version: str) -> str:
    from tests.builders import small_chat
    groups = ('[{kind = "full_attention", block_size = 16}, '
              '{kind = "sliding_window", block_size = 16, sliding_window = 32}]')
    return (small_chat(130, 40).replace("user_history_tokens = 96", "user_history_tokens = 400")
            .replace("[engine]", f'[engine]\nvllm_version = "{version}"\nkv_groups = {groups}'))


def test_a_release_whose_engine_dies_says_so(tmp_path):
    # 0.20.0 counts a sliding window's blocks capped at its admission cap on every step
    # (19 blocks here: cdiv(min(32 - 1 + 256, 1024), 16) + 1), so a decode step crossing a
    # block boundary with one block free counts 1 (full attention's) and takes 2: vLLM's pool
    # raises and the engine dies. 0.20.2 counts 2, preempts and finishes the workload.
    for version, stopped, detail in (
            ("0.20.0", "engine_dead", "ValueError: Cannot get 1 free blocks from the pool"),
            ("0.20.2", None, None)):
        scen = tmp_path / f"{version}.toml"
        scen.write_text(_window_chat(version))
        proc = _kvsim("run", str(scen), "--out", str(tmp_path / version), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        s = json.loads((tmp_path / version / "summary.json").read_text())
        assert (s["stopped_by"], s["stop_detail"]) == (stopped, detail)
        assert (s["num_finished"] < 40) == (stopped is not None)
        assert (f"vLLM's engine core dies here: {detail}" in proc.stdout) == (stopped is not None)
