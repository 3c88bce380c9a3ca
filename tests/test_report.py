"""Figures and kvsim report: files written, matplotlib only on demand, derived notes, one
self-contained HTML page, and that page as headless Chromium shows it."""

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builders import small_chat

from kvsim import plots, report
from kvsim.cli import main

ROOT = Path(__file__).resolve().parents[1]

SPEC = small_chat(num_gpu_blocks=300, num_requests=20) + """
[speculative]
method = "eagle"
num_speculative_tokens = 3
acceptance_rates = [1.0, 0.0, 0.0]
"""


def test_acceptance_by_position_follows_the_rates(tmp_path):
    # The first draft is always accepted and the second never: every verify step accepts
    # exactly one token at position 1, none at 2 or 3 (vLLM's num_accepted_tokens_per_pos).
    (tmp_path / "s.toml").write_text(SPEC)
    assert main(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out"), "-q"]) == 0
    sd = json.loads((tmp_path / "out" / "summary.json").read_text())["spec_decode"]
    verifies = sd["num_accepted_tokens"]  # one accepted token per verify step
    assert sd["num_accepted_tokens_per_pos"] == [verifies, 0, 0]
    assert sd["acceptance_rate_per_pos"] == [1.0, 0.0, 0.0]
    assert sd["mean_acceptance_length"] == 2.0


def test_run_imports_matplotlib_only_for_plots(tmp_path):
    (tmp_path / "s.toml").write_text(SPEC)
    code = ("import sys; from kvsim.cli import main; main(sys.argv[1:]); "
            "print('matplotlib' in sys.modules)")
    for extra, expected in (([], "False"), (["--plots"], "True")):
        out = tmp_path / f"out{len(extra)}"
        done = subprocess.run([sys.executable, "-c", code, "run", str(tmp_path / "s.toml"), "--out",
                               str(out), "-q", *extra], capture_output=True, text=True, cwd=ROOT)
        assert done.stdout.strip() == expected, done.stderr
    figures = sorted(p.name for p in (tmp_path / "out1" / "plots").iterdir())
    # One run: every figure but latency against throughput (which needs two runs or more).
    assert figures == sorted(f"{n}.{ext}" for n in (
        "latency_cdfs", "ttft_vs_arrival", "goodput", "hit_lengths", "hit_rate_over_time", "kv_usage",
        "batch_tokens", "preemptions", "acceptance_by_position") for ext in ("png", "svg"))
    assert not (tmp_path / "out0" / "plots").exists()


@pytest.fixture(scope="module")
def halving(tmp_path_factory):
    """kvsim compare of scenarios/mtp_prefix_halving.toml (DeepSeek-V3 groups of 128 and
    16,384 tokens, vLLM 0.22.1, the same 46,240-token prompt twice)."""
    out = tmp_path_factory.mktemp("halving") / "cmp"
    scenario = ROOT / "scenarios" / "mtp_prefix_halving.toml"
    assert main(["compare", str(scenario), "--out", str(out), "-q"]) == 0
    return out


def test_notes_explain_the_mtp_halving(halving):
    kind, runs, rows = report.load_runs(halving)
    notes = report.notes(kind, runs, rows, halving)
    # The scenario's comment: with prefix caching alone the second request hits 32,768 tokens
    # (two 16,384-token units); with MTP, 16,384. Over the two requests the mean hit is
    # 16,384 vs 8,192: the cut is 8,192, one lcm unit of the one request that hit.
    assert any(n.startswith("mtp cut the mean hit length by 8,192 tokens (16,384 → 8,192, "
                            "prefix caching vs mtp + prefix caching): hit alignment lcm(128, 16,384) "
                            "= 16,384 tokens with the EAGLE last-block drop (vLLM 0.22.1); "
                            "1 request lost exactly one unit of 16,384 tokens") for n in notes), notes


@pytest.fixture(scope="module")
def halving_report(halving):
    assert main(["report", str(halving), "-q"]) == 0
    return halving / "report.html"


def test_report_is_one_self_contained_page(halving, halving_report):
    out = halving_report
    text = out.read_text()
    # Nothing is fetched from elsewhere: no external scripts, styles or images.
    assert not re.search(r'(src|href)="(?!data:)', text)
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    pngs = sorted((halving / "plots").glob("*.png"))
    assert len(images) == len(pngs) == 10  # every figure applies: four runs, two with drafting
    assert sorted(base64.b64decode(i) for i in images) == sorted(p.read_bytes() for p in pngs)
    for variant in ("neither", "prefix caching", "mtp", "mtp + prefix caching"):
        assert f"<td>{variant}</td>" in text
    assert "vllm_version = &quot;0.22.1&quot;" in text  # the resolved scenarios


def test_report_on_a_sweep_names_the_preemption_threshold(tmp_path):
    scenario = (SPEC.replace('method = "eagle"', 'method = "none"')
                .replace("max_model_len = 1024", "max_model_len = 256")
                .replace("request_rate = 40.0", "request_rate = inf")
                .replace("user_history_tokens = 96", "user_history_tokens = 0")
                .replace("input_tokens = 24", "input_tokens = 120"))
    (tmp_path / "s.toml").write_text(scenario)
    out = tmp_path / "sw"
    # Every request: 64 shared + 120 own prompt tokens (12 blocks of 16, 4 shared) growing to
    # 224 tokens (14 blocks) by its last output token. 300 blocks hold all 20 whole (4 + 20 x 10
    # = 204): no preemption. 41 blocks (40 usable) admit 4 (4 + 4 x 8 = 36; a fifth needs 8 more),
    # which all arrive at t = 0 and decode together: by their last token they need 4 + 4 x 10 =
    # 44 blocks, so at least one is preempted.
    assert main(["sweep", str(tmp_path / "s.toml"), "--grid", "engine.num_gpu_blocks=41,300",
                 "--out", str(out), "-q", "--no-plots"]) == 0
    rows = plots.read_csv(out / "sweep.csv")
    assert int(rows[0]["num_preemptions"]) > 0 and rows[1]["num_preemptions"] == "0"
    notes = report.threshold_notes(["engine.num_gpu_blocks", "run.seed"], rows)
    assert notes == ["No preemptions from engine.num_gpu_blocks = 300 up; "
                     f"{rows[0]['num_preemptions']} at 41."]
    assert main(["report", str(out), "-q"]) == 0
    assert "sweep_metrics" in (out / "report.html").read_text()


def test_report_of_something_else_is_a_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    (tmp_path / "sweep.json").write_text("{}")
    assert main(["report", str(tmp_path)]) == 2
    assert "the sweep has not finished" in capsys.readouterr().err


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed")
def test_report_in_headless_chromium(halving_report, tmp_path):
    import matplotlib.image

    shot = tmp_path / "report.png"
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1280,2000", f"--screenshot={shot}", halving_report.as_uri()],
                   capture_output=True, timeout=120, check=True)
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (2000, 1280)
    # The page is drawn: a white sheet with text, tables and figures in several colours.
    rgb = (pixels[..., :3] * 255).astype(int)
    colours = {tuple(c) for c in rgb[::7, ::7].reshape(-1, 3)}
    assert len(colours) > 200
    # The notes box (light blue, #f0f6ff) sits near the top of the page.
    top = rgb[:400]
    assert ((top[..., 0] == 0xf0) & (top[..., 1] == 0xf6) & (top[..., 2] == 0xff)).sum() > 20000


def test_report_title_says_what_varies(tmp_path):
    scen = tmp_path / "s.toml"
    scen.write_text(SPEC)
    out = tmp_path / "cmp"
    assert main(["compare", str(scen), "--out", str(out), "-q",
                 "--vary", "engine.vllm_version=0.22.1,0.32.0,0.33.0"]) == 0
    assert main(["report", str(out), "-q"]) == 0
    text = (out / "report.html").read_text()
    assert "vLLM 0.22.1 / 0.32.0 / 0.33.0 (varied) semantics" in text
    assert "vLLM 0.22.1 semantics" not in text
