"""kvsim sweep: the grid, validation with one-line errors, points equal to their kvsim run,
resuming after a kill, and the Ray backend giving the same bytes as local processes."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import small_chat

from kvsim import sweep
from kvsim.cli import main
from kvsim.errors import ConfigError
from kvsim.results import is_partial

ROOT = Path(__file__).resolve().parents[1]

BASE = small_chat(num_gpu_blocks=200, num_requests=24) + "[run]\nseed = 3\n"

SWEEP = """
scenario = "base.toml"
repeats = 2
[grid]
engine.num_gpu_blocks = [80, 160, 400]
[[points]]
speculative.method = "none"
[[points]]
speculative = { method = "eagle", num_speculative_tokens = 2 }
"""


def write(tmp_path, sweep_text=SWEEP, base=BASE):
    (tmp_path / "base.toml").write_text(base)
    (tmp_path / "sweep.toml").write_text(sweep_text)
    return tmp_path / "sweep.toml"


def read_rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_grid_points_and_repeats(tmp_path):
    sw = sweep.load(write(tmp_path))
    # 3 grid values x 2 explicit points x 2 seeds.
    assert len(sw.points) == 12
    assert sw.keys == ("engine.num_gpu_blocks", "speculative.method",
                       "speculative.num_speculative_tokens", "run.seed")
    assert sw.points[0].overrides == {"speculative.method": "none", "engine.num_gpu_blocks": 80,
                                      "run.seed": 3}
    assert sw.points[-1].overrides == {"speculative.method": "eagle", "speculative.num_speculative_tokens": 2,
                                       "engine.num_gpu_blocks": 400, "run.seed": 4}
    assert sw.points[0].name == "num_gpu_blocks=80_method=none_seed=3"
    assert len({p.name for p in sw.points}) == 12


def test_grid_on_a_scenario_from_the_command_line(tmp_path):
    (tmp_path / "base.toml").write_text(BASE)
    sw = sweep.load(tmp_path / "base.toml",
                    ["engine.block_size=16,32", "engine.enable_prefix_caching=true,false"])
    assert [p.name for p in sw.points] == [
        "block_size=16_enable_prefix_caching=true", "block_size=16_enable_prefix_caching=false",
        "block_size=32_enable_prefix_caching=true", "block_size=32_enable_prefix_caching=false"]


@pytest.mark.parametrize("grid, where, what", [
    ('engine.block_sze = [16, 32]', "sweep.toml: grid.engine.block_sze",
     "unknown key (did you mean 'block_size'?)"),
    ('engine.block_size = []', "sweep.toml: grid.engine.block_size", "empty list of values"),
    ('engine.block_size = ["big"]', "sweep.toml: grid.engine.block_size", "must be an integer, got 'big'"),
    ('engine.enable_prefix_caching = [1]', "sweep.toml: grid.engine.enable_prefix_caching",
     "must be true or false"),
    ('engine.block_size = 16', "sweep.toml: grid.engine.block_size", "must be a list of values"),
    ('engin.block_size = [16]', "sweep.toml: grid.engin.block_size", "unknown section"),
    ('block_size = [16]', "sweep.toml: grid.block_size", "section.key"),
])
def test_bad_grids_fail_in_one_line_before_running(tmp_path, capsys, grid, where, what):
    path = write(tmp_path, f'scenario = "base.toml"\n[grid]\n{grid}\n')
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvsim: error: {where}: ") and what in err
    assert not out.exists()


@pytest.mark.parametrize("args, where", [
    (["--grid", "engine.block_size="], "engine.block_size="),
    (["--grid", "engine.max_num_seqs=0"], "--grid engine.max_num_seqs"),
    (["--repeats", "0"], "--repeats: must be a positive integer"),
])
def test_bad_command_line_grids(tmp_path, capsys, args, where):
    path = write(tmp_path)
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "-q", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvsim: error: {where}")


def test_a_bad_combination_names_the_point(tmp_path, capsys):
    # method = eagle alone lacks num_speculative_tokens: only the combination is wrong.
    path = write(tmp_path, 'scenario = "base.toml"\n[grid]\nspeculative.method = ["none", "eagle"]\n')
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "speculative.num_speculative_tokens: missing" in err and "method=eagle" in err


def test_each_point_is_its_own_kvsim_run(tmp_path):
    path = write(tmp_path, 'scenario = "base.toml"\n[grid]\nengine.num_gpu_blocks = [80, 400]\n')
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "-q", "--workers", "2", "--no-plots"]) == 0
    rows = read_rows(out / "sweep.csv")
    assert [(r["point"], r["engine.num_gpu_blocks"], r["run.seed"]) for r in rows] == [
        ("num_gpu_blocks=80", "80", "3"), ("num_gpu_blocks=400", "400", "3")]
    # The same scenario written by hand and run with kvsim run gives the same files, byte for byte.
    (tmp_path / "by_hand.toml").write_text(BASE.replace("num_gpu_blocks = 200", "num_gpu_blocks = 80"))
    assert main(["run", str(tmp_path / "by_hand.toml"), "--out", str(tmp_path / "by_hand"), "-q"]) == 0
    for name in ("requests.csv", "steps.csv", "summary.json", "scenario.resolved.toml"):
        assert (out / "points" / "num_gpu_blocks=80" / name).read_bytes() == \
            (tmp_path / "by_hand" / name).read_bytes()
    # Its row carries the point's own summary.
    summary = json.loads((out / "points" / "num_gpu_blocks=80" / "summary.json").read_text())
    assert int(rows[0]["num_preemptions"]) == summary["num_preemptions"]
    assert float(rows[0]["e2e_mean_s"]) == pytest.approx(summary["e2e_s"]["mean"], rel=1e-8)


def test_progress_counts_the_points_and_those_done_before(tmp_path):
    sw = sweep.load(write(tmp_path))
    calls: list[tuple] = []
    sweep.run(sw, tmp_path / "out", progress=lambda *a: calls.append(a))
    n = len(sw.points)
    assert calls == [(i, n, 0) for i in range(n + 1)]
    calls.clear()
    sweep.run(sw, tmp_path / "out", progress=lambda *a: calls.append(a))  # all done before
    assert calls == [(n, n, n)]


def _sweep_cmd(path, out, *extra):
    return [sys.executable, "-c", "import sys; from kvsim.cli import main; sys.exit(main(sys.argv[1:]))",
            "sweep", str(path), "--out", str(out), "--no-plots", *extra]


def test_kill_and_restart_skips_finished_points(tmp_path):
    path = write(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(_sweep_cmd(path, out, "--workers", "1", "-q"), env=env, start_new_session=True)

    def finished_points():  # not the NAME.partial-* folder of a point being written
        return [p for p in (out / "points").glob("*/summary.json") if not is_partial(p.parent)]
    try:
        deadline = time.monotonic() + 60
        while len(finished_points()) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended too soon"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finished = {p.parent.name: p.stat().st_mtime_ns for p in finished_points()}
    assert 3 <= len(finished) < 12 and not (out / "sweep.csv").exists()
    # Restart: the finished points are not run again; the table equals an uninterrupted sweep's.
    done = subprocess.run(_sweep_cmd(path, out, "--workers", "2"), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"resuming: {len(finished)} of 12 points done before" in done.stderr
    for name, mtime in finished.items():
        assert (out / "points" / name / "summary.json").stat().st_mtime_ns == mtime
    assert not [p for p in (out / "points").iterdir() if is_partial(p)]
    fresh = tmp_path / "fresh"
    assert main(["sweep", str(path), "--out", str(fresh), "-q", "--no-plots"]) == 0
    assert (out / "sweep.csv").read_bytes() == (fresh / "sweep.csv").read_bytes()
    assert len(read_rows(out / "sweep.csv")) == 12


def test_a_changed_point_runs_again(tmp_path):
    path = write(tmp_path, 'scenario = "base.toml"\n[grid]\nengine.num_gpu_blocks = [80, 400]\n')
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "-q", "--no-plots"]) == 0
    before = (out / "points" / "num_gpu_blocks=80" / "summary.json").read_text()
    # The base scenario changed: the same point names now hold stale results.
    (tmp_path / "base.toml").write_text(BASE.replace("num_requests = 24", "num_requests = 12"))
    assert main(["sweep", str(path), "--out", str(out), "-q", "--no-plots"]) == 0
    assert (out / "points" / "num_gpu_blocks=80" / "summary.json").read_text() != before
    assert {r["point"] for r in read_rows(out / "sweep.csv")} == {"num_gpu_blocks=80", "num_gpu_blocks=400"}


def test_an_unrelated_folder_is_not_overwritten(tmp_path, capsys):
    path = write(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["sweep", str(path), "--out", str(out), "-q"]) == 2
    assert "is not a kvsim sweep folder" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


def test_ray_backend_gives_the_same_bytes_as_local_processes(tmp_path):
    pytest.importorskip("ray")
    path = write(tmp_path)
    local, ray_out = tmp_path / "local", tmp_path / "ray"
    assert main(["sweep", str(path), "--out", str(local), "-q", "--no-plots", "--workers", "2"]) == 0
    assert main(["sweep", str(path), "--out", str(ray_out), "-q", "--no-plots", "--workers", "2",
                 "--backend", "ray"]) == 0
    files = sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file())
    assert len(files) == 12 * 4 + 2
    assert files == sorted(p.relative_to(ray_out) for p in ray_out.rglob("*") if p.is_file())
    for f in files:
        assert (local / f).read_bytes() == (ray_out / f).read_bytes(), f


def test_ray_backend_without_ray_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    path = write(tmp_path)
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "-q", "--backend", "ray"]) == 2
    assert capsys.readouterr().err == ("kvsim: error: --backend ray: Ray is not installed: "
                                       "pip install 'kvsim[ray]'\n")


def test_load_rejects_unknown_sweep_keys(tmp_path):
    path = write(tmp_path, 'scenario = "base.toml"\nrepeat = 2\n')
    with pytest.raises(ConfigError, match="unknown sweep key"):
        sweep.load(path)


@pytest.mark.parametrize("text, where, what", [
    ('scenario = "base.toml"\n[grid]\nengine.block_size = [16]\n[[points]]\nengine.block_size = 32\n',
     "sweep.toml: points[0].engine.block_size", "the grid varies engine.block_size already"),
    ('scenario = "base.toml"\nrepeats = 2\n[grid]\nrun.seed = [1, 2]\n',
     "sweep.toml: repeats", "the sweep sets run.seed itself"),
    # The error is about a key the point leaves out: it names that key and the point.
    ('scenario = "base.toml"\n[[points]]\nspeculative.method = "eagle3"\n',
     "base.toml: speculative.num_speculative_tokens", "(at the sweep point speculative.method=eagle3)"),
])
def test_conflicting_sweep_keys(tmp_path, text, where, what):
    with pytest.raises(ConfigError) as err:
        sweep.load(write(tmp_path, text))
    assert err.value.where == where and what in err.value.what


def test_ray_backend_without_ray_fails_before_any_folder(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("ray") is not None:
        pytest.skip("Ray is installed here")
    path = write(tmp_path)
    assert main(["sweep", str(path), "--backend", "ray", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ("kvsim: error: --backend ray: Ray is not installed: "
                                       "pip install 'kvsim[ray]'\n")
    assert not (tmp_path / "o").exists()
