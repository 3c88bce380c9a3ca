"""Figures from result folders (never from a live run): PNG and SVG under ``<folder>/plots/``.

``variants(folder)`` finds the runs in a run, comparison or sweep folder. The figures:

- for a sweep, each headline metric against the swept parameter, one line per variant; for a
  sweep or comparison, latency against throughput;
- the TTFT, TPOT and inter-token-latency CDFs; TTFT against arrival time; goodput against a
  latency SLO (vLLM bench's ``--goodput``);
- prompt vs cached tokens per request; the prefix-cache hit rate over time; KV usage with the
  running and waiting queues; prefill and decode tokens per step against the token budget;
  cumulative preemptions; acceptance by draft position (speculative decoding).

When a folder holds more runs than a figure can show, the figure shows the runs that differ
most (``pick``: farthest-point sampling over their headline numbers), says how many, and
gives each run the same colour in every figure. Every figure is stamped with what it
simulated: kvsim and vLLM versions, model, hardware, cost model. matplotlib (Agg) is imported
only here, and only when a figure is drawn.
"""

from __future__ import annotations

import csv
import json
import math
import textwrap
import tomllib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from kvsim import results
from kvsim.errors import ConfigError
from kvsim.metrics import context_line

MAX_OVERLAID = 8  # runs drawn in one axes
MAX_PANELS = 6  # runs drawn as small multiples (4 for the two-column figures)
MAX_POINTS = 2000  # points per drawn line (long runs are thinned)
NUM_BINS = 120  # time bins of the rate-over-time figures
METRICS = (("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"),
           ("e2e_mean_s", "E2E mean (s)"), ("output_tokens_per_s", "Output tokens/s"),
           ("mean_cached_tokens", "Mean cached tokens per request"),
           ("num_preemptions", "Preemptions"))


def read_csv(path: Path) -> list[dict]:
    with path.open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def columns(path: Path) -> dict[str, np.ndarray]:
    """A CSV file as one array per column: numbers as float (an empty cell is nan), any other
    column (``req_id``) as strings."""
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        head = next(reader, [])
        cells = list(zip(*reader)) or [()] * len(head)
    out: dict[str, np.ndarray] = {}
    for name, values in zip(head, cells):
        try:
            out[name] = np.array([float(v) if v else math.nan for v in values], dtype=float)
        except ValueError:
            out[name] = np.array(values, dtype=object)
    return out


def column(rows: list[dict], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r[name] != ""]


@dataclass(eq=False)
class Variant:
    """One run folder as the figures and the report read it (each file read once)."""

    label: str
    folder: Path

    @cached_property
    def summary(self) -> dict:
        return json.loads((self.folder / "summary.json").read_text(encoding="utf-8"))

    @cached_property
    def resolved_text(self) -> str:
        return (self.folder / "scenario.resolved.toml").read_text(encoding="utf-8")

    @cached_property
    def resolved(self) -> dict:
        return tomllib.loads(self.resolved_text)

    @cached_property
    def requests(self) -> dict[str, np.ndarray]:
        return columns(self.folder / "requests.csv")

    @cached_property
    def steps(self) -> dict[str, np.ndarray]:
        return columns(self.folder / "steps.csv")


def variants(folder: Path) -> list[Variant]:
    """Every run in a result folder, in table order. A sweep's points are labelled by the keys
    that vary between them (``num_gpu_blocks=3000 method=none seed=0``)."""
    kind = results.kind(folder)
    if kind == "run":
        return [Variant(json.loads((folder / "summary.json").read_text())["model"], folder)]
    if kind == "compare":
        from kvsim.compare import slug

        return [Variant(r["variant"], folder / slug(r["variant"])) for r in read_csv(folder / "compare.csv")]
    rows = read_csv(folder / "sweep.csv")
    keys = json.loads((folder / "sweep.json").read_text())["keys"]
    varying = [k for k in keys if len({r[k] for r in rows}) > 1]
    return [Variant(key_label(r, varying) or r["point"], folder / "points" / r["point"]) for r in rows]


def key_label(row: dict, keys: list[str]) -> str:
    """``num_gpu_blocks=3000 method=none``: ``row``'s values of the scenario ``keys``, by name."""
    return " ".join(f"{k.partition('.')[2]}={row[k]}" for k in keys if row[k] != "")


# -- which runs a figure shows -------------------------------------------------------------


def _features(s: dict) -> list[float]:
    """The headline numbers by which two runs differ (latencies on a log scale)."""
    def log(d: dict | None, q: str) -> float:
        return math.log10(max(d[q], 1e-6)) if d and d.get(q) is not None else 0.0
    return [log(s["ttft_s"], "p50"), log(s["ttft_s"], "p99"), log(s["tpot_s"], "p50"),
            log(s["e2e_s"], "mean"), s["prefix_cache_hit_rate"] or 0.0, s["cached_tokens_mean"] or 0.0,
            math.log1p(s["num_preemptions"]), s["kv_usage"]["max"], s["kv_usage"]["mean"],
            (s.get("spec_decode") or {}).get("mean_acceptance_length") or 1.0]


def pick_order(runs: list[Variant]) -> list[int]:
    """Every run's index, the most different first: the first run, then repeatedly the run
    farthest from all those already taken (each headline number scaled to its range over the
    runs). Runs with identical results come last."""
    if not runs:
        return []
    f = np.array([_features(r.summary) for r in runs], dtype=float)
    span = f.max(axis=0) - f.min(axis=0)
    f = (f - f.min(axis=0)) / np.where(span > 0, span, 1.0)
    order = [0]
    nearest = np.linalg.norm(f - f[0], axis=1)
    while len(order) < len(runs):
        nearest[order] = -1.0
        i = int(np.argmax(nearest))  # the first of equals: table order breaks ties
        order.append(i)
        nearest = np.minimum(nearest, np.linalg.norm(f - f[i], axis=1))
    return order


@dataclass
class Shown:
    """The runs a set of figures shows (the same colour for a run in every figure)."""

    runs: list[Variant]
    order: list[int]
    stamp: str

    def pick(self, n: int) -> tuple[list[tuple[Variant, str]], str]:
        """The ``n`` most different runs (table order) with their colours, and a caption part."""
        taken = sorted(self.order[:n])
        colours = {i: f"C{j % 10}" for j, i in enumerate(sorted(self.order[:MAX_OVERLAID]))}
        chosen = [(self.runs[i], colours.get(i, "C0")) for i in taken]
        if len(taken) == len(self.runs):
            return chosen, ""
        return chosen, f" ({len(taken)} of {len(self.runs)} runs: those that differ most)"


# -- drawing -----------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
                         "axes.spines.right": False, "font.size": 9})
    return plt


def _save(fig, stem: Path, title: str, stamp: str) -> Path:
    """Title the figure, stamp what it simulated along its foot and write it."""
    fig.suptitle(textwrap.fill(title, int(11 * fig.get_figwidth())))
    fig.supxlabel(stamp, fontsize=7, color="#5b6570")
    return _write(fig, stem)


def _write(fig, stem: Path) -> Path:
    """``stem``.png and .svg; the PNG's path."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    fig.set_layout_engine("none")  # keep the layout just computed for the PNG
    fig.savefig(stem.with_suffix(".svg"))
    import matplotlib.pyplot as plt

    plt.close(fig)
    return stem.with_suffix(".png")


def _thin(xs, ys) -> tuple:
    step = max(1, math.ceil(len(xs) / MAX_POINTS))
    return xs[::step], ys[::step]


def _tick(v: float) -> str:
    return f"{v / 1e3:g}k" if v >= 1e4 else f"{v:g}"


def _ms_tick(v: float) -> str:
    """A latency tick of an axis in ms: 50 ms below a second, else seconds (2 s, 1,000 s)."""
    return f"{v:g} ms" if v < 1e3 else f"{v / 1e3:,.4g} s"


def _log(ax, which: str, ms: bool = False) -> None:
    """A log scale labelled with plain numbers (50, 100, 2000, 20k; with ``ms``: 50 ms, 2 s,
    1,000 s), not powers of ten; the 2s and 5s between them only when the axis spans at most
    two decades."""
    from matplotlib.ticker import FuncFormatter

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    tick = _ms_tick if ms else _tick

    def minor(v: float, _) -> str:
        low, high = sorted(axis.get_view_interval())
        few = low > 0 and high / low <= 100
        return tick(v) if few and f"{v:g}"[0] in "25" else ""
    axis.set_major_formatter(FuncFormatter(lambda v, _: tick(v)))
    axis.set_minor_formatter(FuncFormatter(minor))


def _legend_right(fig, ax, n: int) -> None:
    """The runs' legend, right of the panels (the foot holds the stamp)."""
    if n > 1:
        handles, labels = ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right center", fontsize=7.5, frameon=False)


def _grid(plt, n: int, cols: int, w: float, h: float, **kw):
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, 0.9 + h * rows), squeeze=False,
                             constrained_layout=True, **kw)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes.flat


def _finite(a: np.ndarray) -> np.ndarray:
    return a[np.isfinite(a)]


def _bins(t: np.ndarray, *weights: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Time bins over ``t`` (bin starts) and each of ``weights`` summed per bin, with the
    count of entries per bin last."""
    top = float(t.max()) if len(t) else 0.0
    edges = np.linspace(0.0, top if top > 0 else 1.0, NUM_BINS + 1)
    which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, NUM_BINS - 1)
    sums = [np.bincount(which, weights=w, minlength=NUM_BINS) for w in (*weights, np.ones_like(t))]
    return edges[:-1], sums


def ends(steps: dict[str, np.ndarray]) -> np.ndarray:
    return steps["start_s"] + steps["duration_s"]


def inter_token_latencies(run: Variant) -> tuple[np.ndarray, np.ndarray, int]:
    """vLLM's inter-token latencies (``vllm:inter_token_latency_seconds``: one per request and
    engine step that gives it tokens after its first): values in seconds and their weights,
    and the number of preempted requests left out.

    A request that was never preempted runs in every engine step from its first token's to its
    last's, so its latencies are the gaps between those steps' ends (with no drafting, their
    count is its output tokens less one); a preempted one waits between some of them, in steps
    requests.csv does not name, so it is left out. A cluster's or data-parallel run's steps are
    taken engine by engine (replica, and rank)."""
    req, st = run.requests, run.steps
    keep = (req["num_preemptions"] == 0) & np.isfinite(req["finish_step"])
    excluded = int(np.count_nonzero(req["num_preemptions"] > 0))
    values, weights = [], []
    keys = [k for k in ("replica", "dp_rank") if k in st]
    engines = sorted({tuple(row) for row in zip(*(st[k] for k in keys))}) if keys else [()]
    for ident in engines:
        mine = np.ones(len(st["step"]), bool)
        r = keep.copy()
        for k, v in zip(keys, ident):
            mine &= st[k] == v
            r &= req[k] == v
        order = np.argsort(st["step"][mine], kind="stable")
        steps, end = st["step"][mine][order], ends(st)[mine][order]
        if len(steps) < 2:
            continue
        first = np.searchsorted(steps, req["first_token_step"][r])
        last = np.searchsorted(steps, req["finish_step"][r])
        count = np.zeros(len(steps) + 1)
        np.add.at(count, first + 1, 1.0)
        np.add.at(count, last + 1, -1.0)
        count = np.cumsum(count)[1:len(steps)]  # requests that get a token at step i + 1
        values.append(np.diff(end))
        weights.append(count)
    if not values:
        return np.empty(0), np.empty(0), excluded
    v, w = np.concatenate(values), np.concatenate(weights)
    return v[w > 0], w[w > 0], excluded


def _cdf(ax, values: np.ndarray, weights: np.ndarray | None, **kw) -> bool:
    if len(values) == 0:
        return False
    order = np.argsort(values, kind="stable")
    v = values[order]
    w = np.ones_like(v) if weights is None else weights[order]
    y = np.cumsum(w) / w.sum()
    ax.step(*_thin(v, y), where="post", lw=1.2, **kw)
    return True


def latency_cdfs(shown: Shown, stem: Path) -> Path | None:
    runs, caption = shown.pick(MAX_OVERLAID)
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4), constrained_layout=True)
    drawn = 0
    left_out = 0
    for run, colour in runs:
        req = run.requests
        a = _cdf(axes[0], 1e3 * _finite(req["ttft_s"]), None, color=colour, label=run.label)
        _cdf(axes[1], 1e3 * _finite(req["tpot_s"]), None, color=colour, label=run.label)
        values, weights, excluded = inter_token_latencies(run)
        _cdf(axes[2], 1e3 * values, weights, color=colour, label=run.label)
        left_out = max(left_out, excluded)
        drawn += a
    if not drawn:
        plt.close(fig)
        return None
    for ax, name in zip(axes, ("TTFT", "TPOT", "inter-token latency")):
        if ax.has_data():
            _log(ax, "x", ms=True)
        ax.set(xlabel=f"{name} (log scale)", ylim=(0, 1.01))
        ax.set_title(name, fontsize=9)
    axes[0].set_ylabel("fraction of requests")
    axes[2].set_ylabel("fraction of inter-token gaps")
    if left_out:
        axes[2].set_title(f"inter-token latency (preempted requests left out: up to {left_out:,})",
                          fontsize=9)
    _legend_right(fig, axes[0], drawn)
    return _save(fig, stem, "Latency CDFs: time to first token, time per output token, inter-token "
                 "latency" + caption, shown.stamp)


def ttft_vs_arrival(shown: Shown, stem: Path) -> Path | None:
    runs, caption = shown.pick(MAX_PANELS)
    plt = _plt()
    fig, axes = _grid(plt, len(runs), min(len(runs), 3), 4.3 if len(runs) > 1 else 8, 2.7,
                      sharey=True)
    drawn = False
    for ax, (run, colour) in zip(axes, runs):
        req = run.requests
        ok = np.isfinite(req["ttft_s"])
        t, y = req["arrival_s"][ok], 1e3 * req["ttft_s"][ok]
        ax.set_title(run.label, fontsize=8, loc="left")
        ax.set(xlabel="arrival time (s)")
        if not len(t):
            continue
        drawn = True
        order = np.argsort(t, kind="stable")
        t, y = t[order], y[order]
        ax.scatter(*_thin(t, y), s=4, color=colour, alpha=0.5, lw=0)
        start, parts = _bins(t, y)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(parts[1] > 0, parts[0] / parts[1], math.nan)
        ax.plot(start, mean, color="k", lw=1, label="mean per interval")
    if not drawn:
        plt.close(fig)
        return None
    axes[0].set_ylabel("TTFT (log scale)")
    _log(axes[0], "y", ms=True)
    axes[0].legend(fontsize=7, frameon=False)
    return _save(fig, stem, "TTFT against arrival time (queueing shows as a rise)" + caption, shown.stamp)


@dataclass(frozen=True)
class Goodput:
    """Service-level objectives as vLLM bench's ``--goodput`` takes them: ms, per request."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    def describe(self) -> str:
        names = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2E latency"}
        return " and ".join(f"{names[k]} ≤ {v:g} ms" for k, v in self.items())

    def items(self) -> list[tuple[str, float]]:
        return [(k, v) for k, v in (("ttft", self.ttft), ("tpot", self.tpot), ("e2el", self.e2el))
                if v is not None]


NO_SLO = Goodput()


def parse_goodput(items: list[str]) -> Goodput:
    """``ttft:500 tpot:50`` (vLLM bench serve's ``--goodput`` form) into a ``Goodput``."""
    slo: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ConfigError("--goodput", f"{item!r}: expected NAME:MS with NAME one of ttft, tpot, "
                              "e2el (as vllm bench serve takes it)")
        try:
            ms = float(value)
        except ValueError:
            raise ConfigError("--goodput", f"{item!r}: {value!r} is not a number of ms") from None
        if not math.isfinite(ms) or ms < 0:
            raise ConfigError("--goodput", f"{item!r}: the SLO must be a finite number of ms ≥ 0")
        slo[name] = ms
    return Goodput(**slo)


def request_latencies_ms(run: Variant) -> dict[str, np.ndarray]:
    """Each request's TTFT, TPOT and E2E latency in ms as vLLM bench computes them for
    ``--goodput`` (a one-token answer's TPOT is 0; an unfinished request's are inf)."""
    req = run.requests
    done = np.isfinite(req["e2e_s"])
    tpot = np.where(np.isfinite(req["tpot_s"]), req["tpot_s"], 0.0)
    return {"ttft": np.where(done, 1e3 * req["ttft_s"], math.inf),
            "tpot": np.where(done, 1e3 * tpot, math.inf),
            "e2el": np.where(done, 1e3 * req["e2e_s"], math.inf)}


def num_good(run: Variant, slo: Goodput) -> int:
    """The requests that meet every SLO."""
    lat = request_latencies_ms(run)
    good = np.ones(len(lat["ttft"]), bool)
    for name, ms in slo.items():
        good &= lat[name] <= ms
    return int(good.sum())


def goodput(run: Variant, slo: Goodput) -> float:
    """Requests per second that meet every SLO (vLLM bench's request goodput)."""
    duration = run.summary["sim_time_s"]
    return num_good(run, slo) / duration if duration > 0 else 0.0


def goodput_curves(shown: Shown, stem: Path, slo: Goodput) -> Path | None:
    runs, caption = shown.pick(MAX_OVERLAID)
    if not any(np.isfinite(r.requests["e2e_s"]).any() for r, _ in runs):
        return None
    plt = _plt()
    names = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), constrained_layout=True, sharey=True)
    given = dict(slo.items())
    for ax, (name, text) in zip(axes, names):
        others = [(k, v) for k, v in given.items() if k != name]
        for run, colour in runs:
            lat = request_latencies_ms(run)
            rest = np.ones(len(lat[name]), bool)
            for k, v in others:
                rest &= lat[k] <= v
            x = np.sort(lat[name][rest & np.isfinite(lat[name])])
            if not len(x):
                continue
            per_s = np.arange(1, len(x) + 1) / run.summary["sim_time_s"]
            some = x > 0  # a one-token answer's TPOT of 0 meets every SLO: counted, not drawn
            ax.step(*_thin(x[some], per_s[some]), where="post", lw=1.2, color=colour, label=run.label)
        if name in given:
            ax.axvline(max(given[name], 1e-3), color="k", ls="--", lw=0.9, label=f"SLO {given[name]:g} ms")
        if ax.has_data():
            _log(ax, "x", ms=True)
        held = " and ".join(f"{k} ≤ {v:g} ms" for k, v in others)
        ax.set_title(f"{text} SLO" + (f" (with {held})" if held else ""), fontsize=9)
        ax.set(xlabel=f"{text} SLO (log scale)")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("goodput (requests/s meeting the SLO)")
    _legend_right(fig, axes[0], len(runs))
    title = ("Goodput against a latency SLO (vLLM bench's --goodput" +
             (f"; given: {slo.describe()})" if given else ")"))
    return _save(fig, stem, title + caption, shown.stamp)


def latency_throughput(shown: Shown, folder: Path, stem: Path) -> Path | None:
    """Latency against throughput, one point per run; a sweep's points joined along its swept
    parameter, one line per variant (seeds averaged)."""
    if len(shown.runs) < 2:
        return None
    plt = _plt()
    panels = (("ttft_s", "p50", 1e3, "TTFT p50 (ms)"), ("ttft_s", "p99", 1e3, "TTFT p99 (ms)"),
              ("tpot_s", "p50", 1e3, "TPOT p50 (ms)"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), constrained_layout=True)
    def point(r: Variant, key: str, q: str, scale: float) -> tuple[float, float] | None:
        thr, lat = r.summary["throughput"]["output_tokens_per_s"], r.summary[key]
        return None if thr is None or lat is None or lat.get(q) is None else (thr, scale * lat[q])
    lines: list[tuple[str, list[list[Variant]]]] = []
    sweep = sweep_lines(folder) if (folder / "sweep.json").is_file() else None
    if sweep is not None:
        lines = [(name, [[shown.runs[i] for i in by_x[v]] for v in sweep.xs if v in by_x])
                 for name, by_x in sweep.lines.items()]
        title = f"Latency against throughput, along {sweep.x}"
    if not lines:
        lines = [(r.label, [[r]]) for r in shown.runs]
        title = "Latency against throughput, one point per run"
    for ax, (key, q, scale, text) in zip(axes, panels):
        for i, (name, pts) in enumerate(lines[:10 * MAX_OVERLAID]):
            xy = []
            for members in pts:
                got = [p for p in (point(r, key, q, scale) for r in members) if p is not None]
                if got:
                    xy.append((sum(p[0] for p in got) / len(got), sum(p[1] for p in got) / len(got)))
            if xy:
                ax.plot(*zip(*xy), marker="o", ms=4, lw=1.2, color=f"C{i % 10}", label=name)
        low, high = ax.dataLim.y0, ax.dataLim.y1
        if ax.has_data() and low > 0 and high / low > 30:
            _log(ax, "y", ms=True)
            text += ", log scale"
        ax.set(xlabel="output tokens/s", ylabel=text)
    _legend_right(fig, axes[0], min(len(lines), 12))
    return _save(fig, stem, title, shown.stamp)


def hit_lengths(shown: Shown, stem: Path) -> Path | None:
    runs, caption = shown.pick(MAX_PANELS)
    plt = _plt()
    fig, axes = _grid(plt, len(runs), min(len(runs), 3), 4.3 if len(runs) > 1 else 8, 2.5)
    for ax, (run, _) in zip(axes, runs):
        prompt, cached = _finite(run.requests["prompt_tokens"]), _finite(run.requests["cached_tokens"])
        top = max(float(prompt.max(initial=0)), float(cached.max(initial=0)), 1.0)
        bins = np.linspace(0, top, 41)
        ax.hist(prompt, bins=bins, alpha=0.55, label="prompt tokens (requested)")
        ax.hist(cached, bins=bins, alpha=0.75, label="cached tokens (prefix-cache hit)")
        ax.set(xlabel="tokens per request", ylabel="requests")
        ax.set_title(run.label, fontsize=8, loc="left")
    axes[0].legend(fontsize=7, frameon=False)
    return _save(fig, stem, "Hit length per request: requested vs cached" + caption, shown.stamp)


def hit_rate_over_time(shown: Shown, stem: Path) -> Path | None:
    runs, caption = shown.pick(MAX_OVERLAID)
    runs = [(r, c) for r, c in runs if r.summary["prefix_cache_queries"]]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4), constrained_layout=True)
    for run, colour in runs:
        st = run.steps
        start, (hits, queries, _) = _bins(st["start_s"], st["prefix_cache_hits"], st["prefix_cache_queries"])
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(queries > 0, 100 * hits / queries, math.nan)  # no line across gaps
        ax.plot(start, rate, marker=".", ms=3, lw=1, color=colour, label=run.label)
    ax.set(xlabel="simulated time (s)", ylabel="hit rate (% of queried tokens)", ylim=(0, 101))
    _legend_right(fig, ax, len(runs))
    return _save(fig, stem, "Prefix-cache hit rate over time (vllm:prefix_cache_hits / "
                 "vllm:prefix_cache_queries per interval)" + caption, shown.stamp)


def kv_usage(shown: Shown, stem: Path) -> Path | None:
    runs, caption = shown.pick(4)
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 0.9 + 2.3 * len(runs)), squeeze=False,
                             sharex=True, constrained_layout=True)
    for (left, right), (run, _) in zip(axes, runs):
        st = run.steps
        t = st["start_s"]
        left.fill_between(*_thin(t, 100 * st["kv_usage"]), color="C0", alpha=0.35, lw=0.8, step="post")
        left.set(ylabel="KV usage (%)", ylim=(0, 101))
        left.set_title(run.label, fontsize=8, loc="left")
        right.step(*_thin(t, st["num_running"]), where="post", color="C2", lw=1, label="running")
        right.step(*_thin(t, st["num_waiting"]), where="post", color="C3", lw=1, label="waiting")
        right.set(ylabel="requests")
    axes[0][1].legend(fontsize=7, frameon=False)
    axes[-1][0].set_xlabel("simulated time (s)")
    axes[-1][1].set_xlabel("simulated time (s)")
    return _save(fig, stem, "KV cache usage and the running / waiting queues over time" + caption,
                 shown.stamp)


def batch_tokens(shown: Shown, stem: Path) -> Path | None:
    runs, caption = shown.pick(4)
    plt = _plt()
    fig, axes = _grid(plt, len(runs), min(len(runs), 2), 6 if len(runs) > 1 else 9, 2.6)
    for ax, (run, _) in zip(axes, runs):
        st = run.steps
        start, (pre, dec, n) = _bins(st["start_s"], st["num_prefill_tokens"], st["num_decode_tokens"])
        ok = n > 0
        t, pre, dec, n = start[ok], pre[ok] / n[ok], dec[ok] / n[ok], n[ok]
        ax.fill_between(t, 0, pre, step="post", color="C1", alpha=0.6, lw=0, label="prefill tokens")
        ax.fill_between(t, pre, pre + dec, step="post", color="C0", alpha=0.6, lw=0, label="decode tokens")
        budget = run.resolved["engine"].get("max_num_batched_tokens")
        if budget:
            ax.axhline(budget, color="k", ls="--", lw=0.9, label=f"max_num_batched_tokens = {budget:,}")
        ax.set(xlabel="simulated time (s)", ylabel="tokens per step (mean)")
        ax.set_ylim(bottom=0)
        ax.set_title(run.label, fontsize=8, loc="left")
    axes[0].legend(fontsize=7, frameon=False, loc="upper right")
    return _save(fig, stem, "Prefill and decode tokens per step against the token budget" + caption,
                 shown.stamp)


def preemptions(shown: Shown, stem: Path) -> Path | None:
    runs, caption = shown.pick(MAX_OVERLAID)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.8), constrained_layout=True)
    for run, colour in runs:
        st = run.steps
        ax.step(*_thin(st["start_s"], np.cumsum(st["num_preempted"])), where="post", lw=1.2,
                color=colour, label=run.label)
    ax.set(xlabel="simulated time (s)", ylabel="preemptions so far")
    ax.set_ylim(bottom=0)
    _legend_right(fig, ax, len(runs))
    return _save(fig, stem, "Preemptions over time" + caption, shown.stamp)


def acceptance(shown: Shown, stem: Path) -> Path | None:
    runs, caption = shown.pick(MAX_OVERLAID)
    rates = []
    for run, colour in runs:
        sd = run.summary.get("spec_decode") or {}
        if sd.get("acceptance_rate_per_pos"):
            rates.append((f"{run.label} ({sd['method']})", sd["acceptance_rate_per_pos"], colour))
    if not rates:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.8), constrained_layout=True)
    width = 0.8 / len(rates)
    for j, (label, r, colour) in enumerate(rates):
        ax.bar([i + j * width for i in range(len(r))], [100 * x for x in r], width, label=label,
               color=colour)
    k = max(len(r) for _, r, _ in rates)
    ax.set_xticks([i + width * (len(rates) - 1) / 2 for i in range(k)], [str(i + 1) for i in range(k)])
    ax.set(xlabel="draft position", ylabel="accepted (% of verify steps)", ylim=(0, 100))
    _legend_right(fig, ax, len(rates))
    return _save(fig, stem, "Acceptance by draft position (vLLM's num_accepted_tokens_per_pos)" + caption,
                 shown.stamp)


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


@dataclass(frozen=True)
class SweepLines:
    """A sweep's points as lines: along ``x`` (its values ``xs`` in axis order, numerically
    when they are numbers), one line per combination of the other swept keys, each line's
    points by x value as indices of sweep.csv's rows (seeds to be averaged)."""

    rows: list[dict]
    x: str
    numeric: bool
    xs: list[str]
    lines: dict[str, dict[str, list[int]]]


def sweep_lines(folder: Path) -> SweepLines | None:
    """``folder``'s sweep as ``SweepLines``; None when no key but the seed varies."""
    keys = json.loads((folder / "sweep.json").read_text())["keys"]
    rows = read_csv(folder / "sweep.csv")
    axes_keys = sweep_axes(keys, rows)
    if axes_keys is None:
        return None
    x, line_keys = axes_keys
    xs = list(dict.fromkeys(r[x] for r in rows))
    numeric = all(number(v) is not None for v in xs)
    if numeric:
        xs.sort(key=float)
    lines: dict[str, dict[str, list[int]]] = {}
    for i, r in enumerate(rows):
        lines.setdefault(key_label(r, line_keys) or "all points", {}).setdefault(r[x], []).append(i)
    return SweepLines(rows, x, numeric, xs, lines)


def sweep_metrics(folder: Path, stem: Path, stamp: str) -> Path | None:
    sweep = sweep_lines(folder)
    if sweep is None:
        return None
    rows, x, xs, numeric = sweep.rows, sweep.x, sweep.xs, sweep.numeric
    pos = {v: (number(v) if numeric else i) for i, v in enumerate(xs)}
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.8), constrained_layout=True)
    for ax, (metric, title) in zip(axes.flat, METRICS):
        for i, (name, by_x) in enumerate(sweep.lines.items()):
            pts = []
            for v in xs:
                vals = [float(rows[j][metric]) for j in by_x.get(v, ()) if rows[j][metric] != ""]
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
            _log(ax, "y", ms=metric.endswith("_ms"))
            title += ", log scale"
        ax.set_title(title)
        ax.set_xlabel(x)
        if not numeric:
            ax.set_xticks(range(len(xs)), xs, rotation=20, ha="right")
    _legend_right(fig, axes.flat[0], len(sweep.lines))
    seeds = len({r.get("run.seed") for r in rows})
    return _save(fig, stem, f"Headline metrics against {x}" + (f" (mean of {seeds} seeds, bars: min-max)"
                                                              if seeds > 1 else ""), stamp)


def write_figures(folder: Path, slo: Goodput = NO_SLO, runs: list[Variant] | None = None) -> list[Path]:
    """Draw every figure that applies to the result folder; returns the PNG paths."""
    runs = variants(folder) if runs is None else runs
    shown = Shown(runs, pick_order(runs), context_line([r.summary for r in runs]))
    out = folder / "plots"
    drawn = []
    if (folder / "sweep.json").is_file():
        drawn.append(sweep_metrics(folder, out / "sweep_metrics", shown.stamp))
    drawn += [latency_throughput(shown, folder, out / "latency_throughput"),
              latency_cdfs(shown, out / "latency_cdfs"), ttft_vs_arrival(shown, out / "ttft_vs_arrival"),
              goodput_curves(shown, out / "goodput", slo), hit_lengths(shown, out / "hit_lengths"),
              hit_rate_over_time(shown, out / "hit_rate_over_time"), kv_usage(shown, out / "kv_usage"),
              batch_tokens(shown, out / "batch_tokens"), preemptions(shown, out / "preemptions"),
              acceptance(shown, out / "acceptance_by_position")]
    return [p for p in drawn if p is not None]
