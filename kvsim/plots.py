"""Figures from result folders (never from a live run): PNG and SVG under ``<folder>/plots/``.

``variants(folder)`` finds the runs in a run, comparison or sweep folder; each figure overlays
them: TTFT CDF, prompt vs cached tokens per request, KV usage with the running and waiting
queues, cumulative preemptions, acceptance by draft position (speculative decoding) and, for
a sweep, each headline metric against the swept parameter with one line per variant.
matplotlib (Agg) is imported only here, and only when a figure is drawn.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from kvsim import results

MAX_RUNS = 6  # runs overlaid in the per-run figures (a sweep's first points)
MAX_LINES = 2000  # points per drawn line (long runs are thinned)
METRICS = (("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"),
           ("e2e_mean_s", "E2E mean (s)"), ("output_tokens_per_s", "Output tokens/s"),
           ("mean_cached_tokens", "Mean cached tokens per request"),
           ("num_preemptions", "Preemptions"))


def read_csv(path: Path) -> list[dict]:
    with path.open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r[name] != ""]


def variants(folder: Path) -> list[tuple[str, Path]]:
    """(label, run folder) of every run in a result folder, in table order."""
    kind = results.kind(folder)
    if kind == "run":
        return [(json.loads((folder / "summary.json").read_text())["model"], folder)]
    if kind == "compare":
        from kvsim.compare import slug

        return [(r["variant"], folder / slug(r["variant"])) for r in read_csv(folder / "compare.csv")]
    return [(r["point"], folder / "points" / r["point"]) for r in read_csv(folder / "sweep.csv")]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
                         "axes.spines.right": False, "font.size": 9})
    return plt


def _save(fig, stem: Path) -> Path:
    stem.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    fig.set_layout_engine("none")  # keep the layout just computed for the PNG
    fig.savefig(stem.with_suffix(".svg"))
    import matplotlib.pyplot as plt

    plt.close(fig)
    return stem.with_suffix(".png")


def _thin(xs: list, ys: list) -> tuple[list, list]:
    step = max(1, math.ceil(len(xs) / MAX_LINES))
    return xs[::step], ys[::step]


def _log(ax, which: str) -> None:
    """A log scale labelled with plain numbers (50, 100, 2000), not powers of ten."""
    from matplotlib.ticker import FuncFormatter

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))


def _legend(ax, n: int) -> None:
    if 1 < n <= 12:
        ax.legend(fontsize=7, frameon=False)


def ttft_cdf(runs, stem: Path) -> Path | None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.2), constrained_layout=True)
    drawn = 0
    for label, folder in runs:
        ttft = sorted(v * 1e3 for v in column(read_csv(folder / "requests.csv"), "ttft_s"))
        if not ttft:
            continue
        xs, ys = _thin(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))])
        ax.step(xs, ys, where="post", label=label, lw=1.2)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    _log(ax, "x")
    ax.set(xlabel="TTFT (ms, log scale)", ylabel="fraction of requests", ylim=(0, 1.01),
           title="Time to first token, CDF")
    _legend(ax, drawn)
    return _save(fig, stem)


def _pick(runs: list, n: int = MAX_RUNS) -> tuple[list, str]:
    """At most ``n`` runs, evenly spread over the list; and a caption saying so."""
    if len(runs) <= n:
        return runs, ""
    idx = sorted({round(i * (len(runs) - 1) / (n - 1)) for i in range(n)})
    return [runs[i] for i in idx], f" ({len(idx)} of {len(runs)} runs)"


def _grid(plt, n: int, cols: int, w: float, h: float):
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, 0.8 + h * rows), squeeze=False,
                             constrained_layout=True)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes.flat


def hit_lengths(runs, stem: Path) -> Path | None:
    plt = _plt()
    runs, caption = _pick(runs)
    fig, axes = _grid(plt, len(runs), min(len(runs), 3), 4.2 if len(runs) > 1 else 7.5, 2.5)
    for ax, (label, folder) in zip(axes, runs):
        rows = read_csv(folder / "requests.csv")
        prompt, cached = column(rows, "prompt_tokens"), column(rows, "cached_tokens")
        top = max(prompt + cached + [1.0])
        bins = [top * i / 40 for i in range(41)]
        ax.hist(prompt, bins=bins, alpha=0.55, label="prompt tokens (requested)")
        ax.hist(cached, bins=bins, alpha=0.75, label="cached tokens (prefix-cache hit)")
        ax.set(xlabel="tokens per request", ylabel="requests")
        ax.set_title(label, fontsize=8, loc="left")
    axes[0].legend(fontsize=7, frameon=False)
    fig.suptitle("Hit length per request: requested vs cached" + caption)
    return _save(fig, stem)


def kv_usage(runs, stem: Path) -> Path | None:
    plt = _plt()
    runs, caption = _pick(runs, 4)
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 0.8 + 2.3 * len(runs)), squeeze=False,
                             sharex=True, constrained_layout=True)
    for (left, right), (label, folder) in zip(axes, runs):
        steps = read_csv(folder / "steps.csv")
        t = column(steps, "start_s")
        left.fill_between(*_thin(t, [100 * u for u in column(steps, "kv_usage")]), color="C0", alpha=0.35,
                          lw=0.8, step="post")
        left.set(ylabel="KV usage (%)", ylim=(0, 101))
        left.set_title(label, fontsize=8, loc="left")
        right.step(*_thin(t, column(steps, "num_running")), where="post", color="C2", lw=1, label="running")
        right.step(*_thin(t, column(steps, "num_waiting")), where="post", color="C3", lw=1, label="waiting")
        right.set(ylabel="requests")
    axes[0][1].legend(fontsize=7, frameon=False)
    axes[-1][0].set_xlabel("simulated time (s)")
    axes[-1][1].set_xlabel("simulated time (s)")
    fig.suptitle("KV cache usage and the running / waiting queues over time" + caption)
    return _save(fig, stem)


def preemptions(runs, stem: Path) -> Path | None:
    plt = _plt()
    runs, caption = _pick(runs)
    fig, ax = plt.subplots(figsize=(7.5, 3.6), constrained_layout=True)
    for label, folder in runs:
        steps = read_csv(folder / "steps.csv")
        total, cum = 0, []
        for n in column(steps, "num_preempted"):
            total += int(n)
            cum.append(total)
        ax.step(*_thin(column(steps, "start_s"), cum), where="post", lw=1.2, label=label)
    ax.set(xlabel="simulated time (s)", ylabel="preemptions so far", title="Preemptions over time" + caption)
    ax.set_ylim(bottom=0)
    _legend(ax, len(runs))
    return _save(fig, stem)


def acceptance(runs, stem: Path) -> Path | None:
    rates = []
    for label, folder in _pick(runs)[0]:
        sd = json.loads((folder / "summary.json").read_text()).get("spec_decode") or {}
        if sd.get("acceptance_rate_per_pos"):
            rates.append((f"{label} ({sd['method']})", sd["acceptance_rate_per_pos"]))
    if not rates:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 3.6), constrained_layout=True)
    width = 0.8 / len(rates)
    for j, (label, r) in enumerate(rates):
        ax.bar([i + j * width for i in range(len(r))], [100 * x for x in r], width, label=label)
    k = max(len(r) for _, r in rates)
    ax.set_xticks([i + width * (len(rates) - 1) / 2 for i in range(k)], [str(i + 1) for i in range(k)])
    ax.set(xlabel="draft position", ylabel="accepted (% of verify steps)", ylim=(0, 100),
           title="Acceptance by draft position (vLLM's num_accepted_tokens_per_pos)")
    _legend(ax, len(rates))
    return _save(fig, stem)


def number(v: str):
    try:
        return float(v)
    except ValueError:
        return None


def sweep_axes(keys: list[str], rows: list[dict]) -> tuple[str, list[str]] | None:
    """The x parameter (the numeric key with most values, else the key with most values) and
    the keys whose combinations make the lines; seeds are averaged, not lines."""
    varying = [k for k in keys if k != "run.seed" and len({r[k] for r in rows}) > 1]
    if not varying:
        return None
    numeric = [k for k in varying if all(number(r[k]) is not None for r in rows)]
    x = max(numeric or varying, key=lambda k: len({r[k] for r in rows}))
    return x, [k for k in varying if k != x]


def sweep_metrics(folder: Path, stem: Path) -> Path | None:
    keys = json.loads((folder / "sweep.json").read_text())["keys"]
    rows = read_csv(folder / "sweep.csv")
    axes_keys = sweep_axes(keys, rows)
    if axes_keys is None:
        return None
    x, line_keys = axes_keys
    xs = list(dict.fromkeys(r[x] for r in rows))
    numeric = all(number(v) is not None for v in xs)
    pos = {v: (number(v) if numeric else i) for i, v in enumerate(xs)}
    def line_of(r):
        return " ".join(f"{k.partition('.')[2]}={r[k]}" for k in line_keys if r[k] != "") or "all points"

    lines = list(dict.fromkeys(line_of(r) for r in rows))
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.6), constrained_layout=True)
    for ax, (metric, title) in zip(axes.flat, METRICS):
        for i, name in enumerate(lines):
            pts = []
            for v in xs:
                vals = [float(r[metric]) for r in rows
                        if r[x] == v and r[metric] != "" and line_of(r) == name]
                if vals:
                    pts.append((pos[v], sum(vals) / len(vals), min(vals), max(vals)))
            if not pts:
                continue
            px, mean, lo, hi = zip(*pts)
            err = [[m - a for m, a in zip(mean, lo)], [b - m for m, b in zip(mean, hi)]]
            ax.errorbar(px, mean, yerr=err, marker="o", ms=3.5, lw=1.2, capsize=2, color=f"C{i % 10}",
                        label=name)
        low, high = ax.dataLim.y0, ax.dataLim.y1
        if low > 0 and high / low > 30:  # e.g. TTFT from queueing seconds down to tens of ms
            _log(ax, "y")
            title += ", log scale"
        ax.set_title(title)
        ax.set_xlabel(x)
        if not numeric:
            ax.set_xticks(range(len(xs)), xs, rotation=20, ha="right")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if len(lines) > 1:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(lines)), fontsize=8,
                   frameon=False)
    seeds = len({r.get("run.seed") for r in rows})
    fig.suptitle(f"Headline metrics against {x}" + (f" (mean of {seeds} seeds, bars: min-max)"
                                                   if seeds > 1 else ""))
    return _save(fig, stem)


def write_figures(folder: Path) -> list[Path]:
    """Draw every figure that applies to the result folder; returns the PNG paths."""
    runs = variants(folder)
    out = folder / "plots"
    drawn = [ttft_cdf(runs, out / "ttft_cdf"), hit_lengths(runs, out / "hit_lengths"),
             kv_usage(runs, out / "kv_usage"), preemptions(runs, out / "preemptions"),
             acceptance(runs, out / "acceptance_by_position")]
    if (folder / "sweep.json").is_file():
        drawn.insert(0, sweep_metrics(folder, out / "sweep_metrics"))
    return [p for p in drawn if p is not None]
