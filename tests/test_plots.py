"""The figures: which runs they show, their labels and stamps, and the numbers drawn (inter-token
latencies, goodput, latency against throughput), each against what the result files say on
their own; and the report page's layout at desktop and phone widths in headless Chromium."""

import csv
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from builders import small_chat

from kvsim import plots, report
from kvsim.cli import main

ROOT = Path(__file__).resolve().parents[1]

SPEC = small_chat(num_gpu_blocks=300, num_requests=24)


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def drawn(monkeypatch):
    """Every figure drawn, by file stem: (figure, its title, its stamp); nothing is written."""
    figures = {}

    def keep(fig, stem):
        figures[stem.name] = (fig, fig._suptitle.get_text().replace("\n", " "), fig._supxlabel.get_text())
        return stem.with_suffix(".png")
    monkeypatch.setattr(plots, "_write", keep)
    yield figures
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sweep of 12 points: 3 pool sizes x speculative decoding off / EAGLE x 2 seeds."""
    tmp = tmp_path_factory.mktemp("sweep")
    (tmp / "s.toml").write_text(SPEC + '[speculative]\nnum_speculative_tokens = 2\n')
    out = tmp / "sw"
    assert main(["sweep", str(tmp / "s.toml"), "--grid", "engine.num_gpu_blocks=70,120,300",
                 "--grid", "speculative.method=none,eagle", "--repeats", "2", "--out", str(out),
                 "-q", "--no-plots"]) == 0
    return out


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """kvsim compare of the 46,240-token prompt twice over three releases, MTP first: 0.22.1
    and 0.32.0 drop the last matched block with MTP, 0.33.0 does not."""
    out = tmp_path_factory.mktemp("versions") / "cmp"
    assert main(["compare", str(ROOT / "scenarios" / "mtp_prefix_halving.toml"), "--out", str(out), "-q",
                 "--vary", "engine.vllm_version=0.22.1,0.32.0,0.33.0",
                 "--vary", "speculative.method=mtp,none"]) == 0
    return out


def test_figures_show_every_distinct_result(versions, drawn):
    runs = plots.variants(versions)
    assert [r.label for r in runs][:2] == ["vllm_version=0.22.1 method=mtp",
                                           "vllm_version=0.22.1 method=none"]
    # Three distinct results among six runs: without MTP (every release alike), MTP on 0.22.1 and
    # 0.32.0 (half the hit) and MTP on 0.33.0. Spreading 4 panels evenly over 6 runs (runs 1, 3,
    # 4, 6) would leave out 0.33.0 with MTP.
    def result(r):
        return (r.summary["cached_tokens_mean"], round(r.summary["ttft_s"]["p50"], 9))
    distinct = {result(r) for r in runs}
    assert len(distinct) == 3
    plots.write_figures(versions, runs=runs)
    fig, title, _ = drawn["kv_usage"]
    shown = {ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")}
    assert len(shown) == 4 and "(4 of 6 runs: those that differ most)" in title
    assert {result(r) for r in runs if r.label in shown} == distinct


def test_a_sweep_labels_the_lines_it_draws(sweep, drawn):
    runs = plots.variants(sweep)
    assert len(runs) == 12
    assert runs[0].label == "num_gpu_blocks=70 method=none seed=0"  # the keys that vary, readable
    plots.write_figures(sweep, runs=runs)
    fig, title, _ = drawn["latency_cdfs"]
    assert f"({plots.MAX_OVERLAID} of 12 runs: those that differ most)" in title
    legend = {t.get_text() for leg in fig.legends for t in leg.get_texts()}
    for ax in fig.axes:
        labels = [line.get_label() for line in ax.get_lines()]
        assert 0 < len(labels) <= plots.MAX_OVERLAID
        assert set(labels) <= legend  # every line drawn is named
    # A run has the same colour in every figure.
    colours = {}
    for fig, _, _ in drawn.values():
        for ax in fig.axes:
            for line in ax.get_lines():
                if line.get_label() in legend:
                    assert colours.setdefault(line.get_label(), line.get_color()) == line.get_color()


def test_every_figure_says_what_it_simulated(versions, drawn):
    plots.write_figures(versions)
    assert len(drawn) == 10
    for _, _, stamp in drawn.values():
        assert stamp == ("kvsim 0.1.0 · vLLM 0.22.1 / 0.32.0 / 0.33.0 (varied) semantics · "
                         "deepseek-v3 on h200 · cost model: roofline (fitted for Hopper)")


def test_inter_token_latencies_add_up_to_each_request_decode_time(sweep):
    for r in plots.variants(sweep):
        values, weights, excluded = plots.inter_token_latencies(r)
        rows = _rows(r.folder / "requests.csv")
        kept = [q for q in rows if q["e2e_s"] and q["num_preemptions"] == "0"]
        assert excluded == sum(q["num_preemptions"] != "0" for q in rows)
        # A request's inter-token latencies add up to its first token to its last.
        decode = sum(float(q["e2e_s"]) - float(q["ttft_s"]) for q in kept)
        assert float((values * weights).sum()) == pytest.approx(decode, rel=1e-6)
        if r.summary.get("spec_decode") is None:  # one token per step: one latency per token
            assert weights.sum() == sum(int(q["output_tokens"]) - 1 for q in kept)
        else:  # drafting: fewer steps than tokens
            assert weights.sum() < sum(int(q["output_tokens"]) - 1 for q in kept)


def test_goodput_counts_the_requests_within_every_slo(sweep):
    run = plots.variants(sweep)[5]
    rows = _rows(run.folder / "requests.csv")
    sim = run.summary["sim_time_s"]
    ttft = sorted(float(q["ttft_s"]) * 1e3 for q in rows)
    slo_ms = ttft[len(ttft) // 2]
    assert plots.goodput(run, plots.Goodput(ttft=slo_ms)) == sum(t <= slo_ms for t in ttft) / sim
    tpot = sorted(float(q["tpot_s"]) * 1e3 for q in rows)
    both = sum(float(q["ttft_s"]) * 1e3 <= slo_ms and float(q["tpot_s"]) * 1e3 <= tpot[3] for q in rows)
    assert plots.goodput(run, plots.Goodput(ttft=slo_ms, tpot=tpot[3])) == both / sim
    assert plots.goodput(run, plots.Goodput(e2el=0.0)) == 0.0


@pytest.mark.parametrize("arg, message", [
    ("ttft", "expected NAME:MS"), ("itl:5", "expected NAME:MS"), ("ttft:fast", "not a number"),
    ("tpot:-1", "finite number of ms"), ("e2el:nan", "finite number of ms")])
def test_goodput_slo_errors_are_one_line(sweep, capsys, arg, message):
    assert main(["report", str(sweep), "--goodput", arg]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--goodput" in err and message in err
    assert not (sweep / "report.html").exists()


def test_latency_against_throughput_follows_the_sweep(sweep, drawn):
    plots.write_figures(sweep)
    fig, title, _ = drawn["latency_throughput"]
    assert title == "Latency against throughput, along engine.num_gpu_blocks"
    rows = _rows(sweep / "sweep.csv")
    ttft_p50 = fig.axes[0]
    lines = {line.get_label(): line for line in ttft_p50.get_lines()}
    assert set(lines) == {"method=none", "method=eagle"}
    for method, line in lines.items():
        want = []
        for blocks in ("70", "120", "300"):  # the seeds' mean at each pool size
            mine = [r for r in rows if r["speculative.method"] == method.split("=")[1]
                    and r["engine.num_gpu_blocks"] == blocks]
            want.append((np.mean([float(r["output_tokens_per_s"]) for r in mine]),
                         np.mean([float(r["ttft_p50_ms"]) for r in mine])))
        assert np.allclose(np.column_stack(line.get_data()), want, rtol=1e-6)


def test_batch_tokens_draws_the_budget_and_the_step_means(sweep, drawn):
    run = plots.variants(sweep)[0]
    plots.write_figures(sweep)
    fig, _, _ = drawn["batch_tokens"]
    budget = {line.get_ydata()[0] for ax in fig.axes for line in ax.get_lines()}
    assert budget == {256}  # max_num_batched_tokens
    steps = _rows(run.folder / "steps.csv")
    assert max(int(s["num_scheduled_tokens"]) for s in steps) <= 256


def test_latencies_in_a_table_read_in_s_or_min():
    # 2,693,032.09 ms is 2,693.03 s, i.e. 44.88 minutes.
    assert report._cell("ttft_p50_ms", "2693032.09") == "44.88 min"
    assert report._cell("ttft_p99_ms", "11549.3") == "11.55 s"
    assert report._cell("tpot_p50_ms", "69.41") == "69.41 ms"
    assert report._cell("e2e_mean_s", "3.5") == "3,500.00 ms"
    assert report._cell("e2e_mean_s", "35") == "35.00 s"


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


MEASURE = """<script>window.addEventListener("load", () => {
  const out = {page: document.documentElement.scrollWidth, window: window.innerWidth, tables: []};
  for (const w of document.querySelectorAll(".table-wrap")) out.tables.push([w.scrollWidth, w.clientWidth]);
  const p = document.createElement("pre"); p.id = "measure"; p.textContent = JSON.stringify(out);
  document.body.appendChild(p);
});</script>"""


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed")
@pytest.mark.parametrize("width", [1400, 390])
def test_sweep_report_fits_desktop_and_phone(sweep, tmp_path, width):
    assert main(["report", str(sweep), "--goodput", "ttft:200", "tpot:20", "--out",
                 str(tmp_path / "r.html"), "-q"]) == 0
    page = (tmp_path / "r.html").read_text().replace("</body>", MEASURE + "</body>")
    (tmp_path / "m.html").write_text(page)
    dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                          f"--window-size={width},900", "--dump-dom", (tmp_path / "m.html").as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    got = json.loads(re.search(r'<pre id="measure">([^<]*)</pre>', dom).group(1).replace("&quot;", '"'))
    assert got["page"] <= got["window"]  # nothing runs off the page sideways
    if width >= 1400:  # the headline table (13 metric columns and goodput) is not clipped
        assert all(scroll <= client for scroll, client in got["tables"])
    else:  # on a phone, the table scrolls inside its own box
        assert got["tables"][0][0] > got["tables"][0][1]
    assert not math.isnan(got["window"])


def test_log_axes_label_only_what_has_room():
    # A TTFT axis from 20 ms to 30 s: the decades alone, in ms then s ("10000" and "20000" side
    # by side ran together); one within two decades also labels its 2s and 5s.
    plt = plots._plt()
    fig, (wide, narrow) = plt.subplots(1, 2)
    wide.plot([20, 30000], [0, 1])
    narrow.plot([20, 800], [0, 1])
    plots._log(wide, "x", ms=True)
    plots._log(narrow, "x", ms=True)
    fig.canvas.draw()

    def labels(ax, minor):
        lo, hi = ax.get_xlim()
        return [t.get_text() for t in ax.xaxis.get_ticklabels(minor=minor)
                if t.get_text() and lo <= t.get_position()[0] <= hi]
    assert labels(wide, False) == ["100 ms", "1 s", "10 s"]
    assert labels(wide, True) == []
    assert labels(narrow, False) == ["100 ms"]
    assert labels(narrow, True) == ["20 ms", "50 ms", "200 ms", "500 ms"]
    plt.close(fig)
