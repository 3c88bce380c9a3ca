"""``kvsim report RUN_DIR``: one self-contained HTML page for a run, a comparison or a sweep.

The page holds the scenario, the headline table, the figures (``kvsim.plots``, embedded as
base64 PNG; the PNG and SVG files stay under ``RUN_DIR/plots``) and notes that kvsim derives
from the results and the resolved scenarios: preemptions and KV headroom, where a swept
parameter stops preemptions, what speculative decoding did to the prefix-cache hits and the
accounting rule behind it (hit alignment, EAGLE block drop or lookahead hashes), acceptance by
position. Everything is read from the result files, nothing from a live run.
"""

from __future__ import annotations

import base64
import html
import json
from math import lcm
from pathlib import Path

from kvsim import plots, results
from kvsim.assemble import spec_setup
from kvsim.compare import COLUMNS
from kvsim.config import parse_scenario
from kvsim.errors import ConfigError
from kvsim.metrics import context_line, over_capacity_text, time_unit
from kvsim.model import GiB
from kvsim.specdec import EAGLE_METHODS

Run = plots.Variant


def alignment(run: Run) -> tuple[int, str]:
    """The hit alignment in tokens and how it arises (block_size, or lcm of the groups')."""
    groups = run.resolved["engine"].get("kv_groups") or []
    sizes = sorted({g["block_size"] for g in groups})
    if len(sizes) > 1:
        return lcm(*sizes), f"lcm({', '.join(f'{b:,}' for b in sizes)})"
    size = sizes[0] if sizes else run.resolved["engine"]["block_size"]
    return size, "block_size"


def load_runs(folder: Path) -> tuple[str, list[Run], list[dict]]:
    """The folder's kind, its runs and its table rows (compare.csv / sweep.csv; a run: none)."""
    kind = results.kind(folder)
    runs = plots.variants(folder)
    rows = []
    if kind == "compare":
        rows = plots.read_csv(folder / "compare.csv")
    elif kind == "sweep":
        rows = plots.read_csv(folder / "sweep.csv")
    return kind, runs, rows


# -- notes -------------------------------------------------------------------------------


def _n(x: float) -> str:
    return f"{x:,.0f}"


def run_notes(run: Run) -> list[str]:
    s = run.summary
    peak = float(run.steps["kv_usage"].max(initial=0.0))
    usable = s["num_gpu_blocks"] - 1
    out = []
    if s["stopped_by"] == "stall":
        out.append(f"vLLM {s['vllm_version']} deadlocks on this workload: the head of the waiting "
                   f"queue can never be admitted; {s['num_finished']} of {s['num_requests']} requests "
                   "finished.")
    elif s["stopped_by"] == "engine_dead":
        out.append(f"vLLM {s['vllm_version']}'s engine core dies on this workload "
                   f"({s['stop_detail']}) after {s['num_steps']} steps; {s['num_finished']} of "
                   f"{s['num_requests']} requests finished.")
    elif s["stopped_by"]:
        out.append(f"The run was cut by run.{s['stopped_by']}: {s['num_finished']} of "
                   f"{s['num_requests']} requests finished.")
    behind = over_capacity_text(s)
    if behind:
        out.append(f"Over capacity: {behind}; its latencies measure the queue more than the engine.")
    if s["num_preemptions"]:
        victims = int((run.requests["num_preemptions"] > 0).sum())
        out.append(f"{_n(s['num_preemptions'])} preemptions hit {_n(victims)} of {_n(s['num_requests'])} "
                   f"requests: KV usage reached {100 * peak:.0f} % of the {_n(usable)} usable blocks.")
    else:
        out.append(f"No preemptions: KV usage peaked at {100 * peak:.1f} % of the {_n(usable)} usable "
                   f"blocks.")
    if s["prefix_cache_queries"]:
        size, how = alignment(run)
        out.append(f"Prefix cache: {100 * s['prefix_cache_hit_rate']:.1f} % of queried tokens hit, "
                   f"{_n(s['cached_tokens_mean'])} tokens per request on average, in whole units of "
                   f"{_n(size)} tokens ({how}).")
    sd = s.get("spec_decode")
    if sd and sd.get("acceptance_rate_per_pos"):
        pos = ", ".join(f"{i + 1}: {100 * r:.0f} %" for i, r in enumerate(sd["acceptance_rate_per_pos"]))
        out.append(f"{sd['method']} (k = {sd['num_speculative_tokens']}): mean acceptance length "
                   f"{sd['mean_acceptance_length']:.2f}; accepted by position {pos}.")
    return out


def _rule(run: Run) -> str:
    """The accounting rule by which an EAGLE-family drafter shortens prefix hits in ``run``."""
    size, how = alignment(run)
    unit = f"hit alignment {how} = {_n(size)} tokens" if how != "block_size" else f"block_size {size}"
    try:
        sc = parse_scenario(run.resolved, run.folder / "scenario.resolved.toml")
    except ConfigError:
        return unit
    setup = spec_setup(sc)
    version = run.summary["vllm_version"]
    retention = sc.engine.prefix_cache_retention_interval
    if retention != "dense" and any(g.kind != "full_attention" for g in sc.engine.kv_groups or ()):
        unit += (", sliding-window/Mamba checkpoints kept only at replay boundaries and "
                 "shared-prefix junctions" + (f" and every {_n(int(retention))} tokens" if retention else "")
                 + f" (prefix_cache_retention_interval = {retention})")
    if setup.eagle_drop:
        return f"{unit} with the EAGLE last-block drop (vLLM {version})"
    if setup.hash_lookahead:
        return (f"{unit} with vLLM {version}'s lookahead block hashes (each block's hash covers "
                f"{setup.hash_lookahead} more token{'s' if setup.hash_lookahead > 1 else ''})")
    return unit


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else (f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}")


def _tokens(v: float) -> str:
    return f"{v:,.0f} token{'' if v == 1 else 's'}" if float(v).is_integer() else f"{_num(v)} tokens"


def _cached_by_request(run: Run) -> dict[str, int]:
    """Each request's cached tokens (0 for one never admitted)."""
    req = run.requests
    return {str(k): int(v) if v == v else 0 for k, v in zip(req["req_id"], req["cached_tokens"])}


def speculative_notes(runs: list[Run]) -> list[str]:
    """For runs that differ only in [speculative] (off vs an EAGLE-family method), both with
    prefix caching: how much the drafter cut the prefix-cache hits, and by which rule."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        rest = {k: v for k, v in r.resolved.items() if k != "speculative"}
        groups.setdefault(json.dumps(rest, sort_keys=True, default=str), []).append(r)
    pairs: dict[str, list[tuple[float, Run, Run, list[int]]]] = {}
    for members in groups.values():
        base = next((r for r in members if r.resolved["speculative"]["method"] == "none"), None)
        if base is None or not base.resolved["engine"]["enable_prefix_caching"]:
            continue
        before = _cached_by_request(base)
        for r in members:
            method = r.resolved["speculative"]["method"]
            if method not in EAGLE_METHODS:
                continue
            after = _cached_by_request(r)
            lost = [before[k] - after[k] for k in before if k in after and after[k] < before[k]]
            cut = base.summary["cached_tokens_mean"] - r.summary["cached_tokens_mean"]
            if lost and cut > 0:
                pairs.setdefault(method, []).append((cut, base, r, lost))
    out = []
    for method, found in pairs.items():
        cut, base, r, lost = max(found, key=lambda p: p[0])
        size, _ = alignment(r)
        one = sum(1 for d in lost if d == size)
        more = sorted(d for d in lost if d != size)
        span = "" if not more else _tokens(more[0]) if more[0] == more[-1] else \
            f"{_tokens(more[0])} to {_tokens(more[-1])}"
        detail = ", ".join(part for part in (
            f"{one} request{'s' if one > 1 else ''} lost exactly one unit of {_tokens(size)}" if one else "",
            f"{len(more)} request{'s' if len(more) > 1 else ''} lost {span}" if more else "") if part)
        head = (f"{method} cut the mean hit length by {_tokens(cut)} "
                f"({_num(base.summary['cached_tokens_mean'])} → {_num(r.summary['cached_tokens_mean'])}, "
                f"{base.label} vs {r.label})")
        if len(found) > 1:
            cuts = [p[0] for p in found]
            head = (f"{method} cut the mean hit length in {len(found)} pairs of runs that differ only in "
                    f"[speculative], by {_tokens(min(cuts))} to {_tokens(max(cuts))} (largest: "
                    f"{base.label} vs {r.label}, {_num(base.summary['cached_tokens_mean'])} → "
                    f"{_num(r.summary['cached_tokens_mean'])})")
        out.append(f"{head}: {_rule(r)}; {detail}.")
    return out


def threshold_notes(keys: list[str], rows: list[dict]) -> list[str]:
    """For a numeric swept key: from which value up no variant preempts any more."""
    axes = plots.sweep_axes(keys, rows)
    if axes is None:
        return []
    x, line_keys = axes
    if not all(plots.number(r[x]) is not None for r in rows):
        return []
    out = []
    for name in dict.fromkeys(tuple(r[k] for k in line_keys) for r in rows):
        mine = [r for r in rows if tuple(r[k] for k in line_keys) == name]
        by_x: dict[float, int] = {}
        for r in mine:
            v = float(r[x])
            by_x[v] = max(by_x.get(v, 0), int(float(r["num_preemptions"] or 0)))
        values = sorted(by_x)
        bad = [v for v in values if by_x[v] > 0]
        if not bad or len(bad) == len(values):
            continue
        free = [v for v in values if by_x[v] == 0 and v > max(bad)]
        if not free:
            continue
        where = plots.key_label(dict(zip(line_keys, name)), line_keys)
        out.append(f"{'With ' + where + ': n' if where else 'N'}o preemptions from {x} = {free[0]:g} up; "
                   f"{by_x[max(bad)]} at {max(bad):g}.")
    return out


def best_notes(rows: list[dict], labels: list[str]) -> list[str]:
    """The runs (``labels``, in ``rows``' order) with the lowest and highest latencies."""
    out = []
    for metric, text, unit in (("e2e_mean_s", "mean E2E latency", "s"), ("ttft_p50_ms", "TTFT p50", "ms")):
        ok = [(float(r[metric]), name) for r, name in zip(rows, labels) if r.get(metric)]
        if len(ok) > 1:
            best, worst = min(ok), max(ok)
            out.append(f"Lowest {text}: {best[1]} ({_num(best[0])} {unit}; highest: {worst[1]}, "
                       f"{_num(worst[0])} {unit}).")
    return out


def goodput_notes(runs: list[Run], slo: plots.Goodput) -> list[str]:
    """Goodput at the SLO given (``kvsim report --goodput``): the run's, or the best and worst."""
    if not slo.items():
        return []
    got = [(plots.goodput(r, slo), r) for r in runs]
    def share(g: float, r: Run) -> str:
        n, good = r.summary["num_requests"], plots.num_good(r, slo)
        return f"{_num(g)} req/s ({good:,} of {n:,} requests, {100 * good / n if n else 0:.0f} %)"
    if len(got) == 1:
        return [f"Goodput at {slo.describe()}: {share(*got[0])}."]
    best = max(got, key=lambda p: p[0])
    worst = min(got, key=lambda p: p[0])
    return [f"Goodput at {slo.describe()}: highest {best[1].label}, {share(*best)}; lowest "
            f"{worst[1].label}, {share(*worst)}."]


def notes(kind: str, runs: list[Run], rows: list[dict], folder: Path,
          slo: plots.Goodput = plots.NO_SLO) -> list[str]:
    """Everything kvsim notices about a result folder, as plain sentences."""
    if kind == "run":
        return run_notes(runs[0]) + goodput_notes(runs, slo) + _cost_note(runs)
    out = speculative_notes(runs)
    if kind == "sweep":
        keys = json.loads((folder / "sweep.json").read_text(encoding="utf-8"))["keys"]
        out += threshold_notes(keys, rows)
    out += best_notes(rows, [r.label for r in runs]) + goodput_notes(runs, slo)
    behind = [r.label for r in runs if r.summary.get("over_capacity")]
    if behind:
        out.append(f"{len(behind)} of {len(runs)} runs are over capacity (requests queue the longer "
                   f"the later they arrive): {', '.join(behind)}.")
    preempting = [r.label for r in runs if r.summary["num_preemptions"]]
    if preempting and len(preempting) < len(runs):
        out.append(f"{len(preempting)} of {len(runs)} runs preempt requests.")
    return out + _cost_note(runs)


def _cost_note(runs: list[Run]) -> list[str]:
    if any("uncalibrated" in r.summary["cost_model"] for r in runs):
        return ["Times come from the uncalibrated roofline cost model: compare them between "
                "variants rather than with a GPU (kvsim calibrate fits a profile)."]
    return []


# -- the page ----------------------------------------------------------------------------

CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d2329;
       margin: 0; background: #f6f7f9; }
main { max-width: 1320px; margin: 0 auto; padding: 28px 32px 60px; background: #fff;
       overflow-wrap: anywhere; }
h1 { font-size: 26px; margin: 0 0 4px; } h2 { font-size: 19px; margin: 34px 0 10px;
       border-bottom: 1px solid #e3e6ea; padding-bottom: 4px; }
.meta { color: #5b6570; margin: 0 0 18px; }
.notes { background: #f0f6ff; border-left: 4px solid #3a7bd5; padding: 10px 18px 10px 34px; margin: 0; }
.notes li { margin: 4px 0; }
.table-wrap { overflow-x: auto; }
table { border-collapse: collapse; font-size: 13px; font-variant-numeric: tabular-nums;
        overflow-wrap: normal; }
th, td { padding: 5px 8px; border-bottom: 1px solid #e8eaed; text-align: right; white-space: nowrap; }
th { background: #f1f3f5; position: sticky; top: 0; white-space: normal; vertical-align: bottom;
     min-width: 3.5em; }
td:first-child, th:first-child { text-align: left; }
tr:nth-child(even) td { background: #fafbfc; }
figure { margin: 18px 0 26px; overflow-x: auto; }
figure img { max-width: 100%; height: auto; border: 1px solid #eceef0; }
figcaption { color: #5b6570; font-size: 13px; }
pre { background: #f6f8fa; padding: 12px; overflow-x: auto; font-size: 12.5px; border-radius: 4px; }
details summary { cursor: pointer; color: #3a7bd5; margin: 6px 0; }
@media (max-width: 640px) { main { padding: 16px 12px 40px; } h1 { font-size: 21px; }
                            figure img { max-width: none; width: 600px; } }
"""

CAPTIONS = {
    "sweep_metrics": "Headline metrics against the swept parameter, one line per variant.",
    "latency_throughput": "Latency against output throughput: up and to the right, the engine "
                          "saturates.",
    "latency_cdfs": "The fraction of requests within each TTFT and TPOT, and of inter-token gaps "
                    "within each inter-token latency (vLLM's inter_token_latency: one per request "
                    "and step that gives it tokens).",
    "ttft_vs_arrival": "Each request's TTFT against when it arrived; the line is the mean per "
                       "interval.",
    "goodput": "Requests per second that meet a latency SLO, as the SLO is tightened or loosened "
               "(kvsim report --goodput ttft:MS tpot:MS e2el:MS sets one, as vllm bench serve does).",
    "hit_lengths": "Per request: prompt tokens requested vs tokens served from the prefix cache.",
    "hit_rate_over_time": "Share of queried prompt tokens served from the prefix cache, per "
                          "interval of simulated time.",
    "kv_usage": "KV cache usage, and the running and waiting queues, over simulated time.",
    "batch_tokens": "Mean prefill and decode tokens per engine step, per interval of simulated "
                    "time, against the token budget.",
    "preemptions": "Cumulative preemptions over simulated time.",
    "acceptance_by_position": "Share of verify steps whose i-th draft token was accepted.",
}

HEADS = {"ttft_p50_ms": "TTFT p50", "ttft_p99_ms": "TTFT p99", "tpot_p50_ms": "TPOT p50",
         "e2e_mean_s": "E2E mean", "requests_per_s": "req/s", "output_tokens_per_s": "out tok/s",
         "prefix_cache_hit_rate": "hit rate %", "mean_cached_tokens": "mean hit tokens",
         "num_preemptions": "preempt&shy;ions", "mean_acceptance_length": "accept len",
         "goodput_req_s": "goodput req/s", "external_prefix_cache_hit_rate": "CPU hit %",
         "kv_offload_load_gib": "CPU loaded GiB", "nixl_pulled_gib": "P/D pulled GiB",
         "num_decode_only": "decode-only"}
LATENCY = {"ttft_p50_ms": 1e-3, "ttft_p99_ms": 1e-3, "tpot_p50_ms": 1e-3, "e2e_mean_s": 1.0}


def _head(key: str) -> str:
    """A column's heading; a dotted key may break after its dots."""
    return HEADS.get(key) or "<wbr>".join(html.escape(p + ".") for p in key.split(".")).rstrip(".")


def _seconds(v: float) -> str:
    """A latency in the unit it reads best in: 69.41 ms, 11.55 s, 44.88 min."""
    unit, scale = time_unit(v)
    return f"{v * scale:,.2f} {unit}"


def _cell(key: str, value: str) -> str:
    if value == "" or key not in HEADS:
        return html.escape(value or "–")
    v = float(value)
    if key in LATENCY:
        return _seconds(v * LATENCY[key])
    if key in ("prefix_cache_hit_rate", "external_prefix_cache_hit_rate"):
        return f"{100 * v:.1f}"
    if key in ("mean_cached_tokens", "num_preemptions", "output_tokens_per_s"):
        return f"{v:,.0f}"
    return f"{v:,.2f}" if abs(v) < 1e3 else f"{v:,.0f}"


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{_head(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(c, r.get(c, ''))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f'<div class="table-wrap"><table><tr>{head}</tr>{body}</table></div>'


def _run_table(s: dict, good: str | None) -> str:
    rows = []
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"), ("queue_s", "queue")):
        d = s.get(key)
        if d is None:
            rows.append([label] + ["–"] * 4)
            continue
        rows.append([label] + [_seconds(d[q]) for q in ("p50", "p90", "p99", "mean")])
    table = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    t = s["throughput"]
    facts = [("requests finished", f"{s['num_finished']:,} of {s['num_requests']:,}"),
             ("simulated time", f"{s['sim_time_s']:,.2f} s in {s['num_steps']:,} steps"),
             ("throughput", "–" if t["requests_per_s"] is None else
              f"{t['requests_per_s']:.2f} req/s, {t['output_tokens_per_s']:,.0f} output tok/s"),
             ("prefix cache", "off" if not s["prefix_cache_queries"] else
              f"{100 * s['prefix_cache_hit_rate']:.1f} % of {s['prefix_cache_queries']:,} queried "
              "tokens hit"),
             ("preemptions", f"{s['num_preemptions']:,}"),
             ("KV pool", f"{s['num_gpu_blocks']:,} blocks of {s['block_size']} tokens")]
    if good is not None:
        facts.append(("goodput", good))
    fact_rows = "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td></tr>" for a, b in facts)
    return (f'<div class="table-wrap"><table><tr><th></th><th>p50</th><th>p90</th><th>p99</th>'
            f"<th>mean</th></tr>{table}</table></div><p></p>"
            f'<div class="table-wrap"><table>{fact_rows}</table></div>' + _pd_table(s.get("pd")))


def _pd_table(pd: dict | None) -> str:
    """A P/D run's prefill and decode pools side by side (the prefill pool's TTFT is its
    prefill: the proxy's max_tokens = 1 requests)."""
    if not pd:
        return ""
    rows = []
    for name, p in (("prefill pool", pd["prefill_pool"]), ("decode pool", pd["decode_pool"])):
        t = p["ttft_s"]
        rows.append([name, f"{len(p['instances'])}", f"{p['num_gpu_blocks_total']:,}",
                     "–" if p["prefix_cache_hit_rate"] is None
                     else f"{100 * p['prefix_cache_hit_rate']:.1f} %",
                     "–" if t is None else _seconds(t["p50"]),
                     "–" if t is None else _seconds(t["p99"]), f"{p['num_preemptions']:,}",
                     f"{100 * p['kv_usage_mean']:.1f} %"])
    head = "".join(f"<th>{h}</th>" for h in ("", "instances", "blocks", "hit rate", "TTFT p50",
                                                "TTFT p99", "preemptions", "KV mean"))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    x, h = pd["nixl_xfer_time_seconds"], pd["prefill_to_first_token_s"]
    facts = [("pulled (NIXL reads)", f"{pd['nixl_bytes_transferred'] / GiB:,.2f} GiB in "
              f"{pd['nixl_num_transfers']:,} reads over {pd['kv_transfer_link']}"
              + ("" if x is None else f", p50 {_seconds(x['p50'])}, p99 {_seconds(x['p99'])}")),
             ("prefill done to first token", "–" if h is None else
              f"p50 {_seconds(h['p50'])}, p99 {_seconds(h['p99'])}"),
             ("decode-only requests", f"{pd['num_decode_only']:,} (non_cached_tokens "
              f"{pd['non_cached_tokens']:,})")]
    fact_rows = "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td></tr>"
                        for a, b in facts)
    return (f'<p></p><div class="table-wrap"><table><tr>{head}</tr>{body}</table></div><p></p>'
            f'<div class="table-wrap"><table>{fact_rows}</table></div>')


def _figure(png: Path) -> str:
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    caption = CAPTIONS.get(png.stem, "")
    return (f'<figure><img alt="{html.escape(png.stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def page(folder: Path, slo: plots.Goodput = plots.NO_SLO) -> str:
    """The report's HTML (draws the figures into ``folder/plots`` first)."""
    kind, runs, rows = load_runs(folder)
    figures = plots.write_figures(folder, slo, runs)
    s = runs[0].summary
    title = {"run": "run", "compare": "comparison", "sweep": "sweep"}[kind]
    parts = [f"<h1>kvsim {title}: {html.escape(folder.resolve().name)}</h1>",
             f'<p class="meta">{html.escape(context_line([r.summary for r in runs]))}</p>',
             "<h2>What kvsim noticed</h2>",
             '<ul class="notes">' + "".join(f"<li>{html.escape(n)}</li>"
                                            for n in notes(kind, runs, rows, folder, slo)) + "</ul>",
             "<h2>Headline numbers</h2>"]
    if kind == "run":
        parts.append(_run_table(s, f"{plots.goodput(runs[0], slo):,.2f} req/s at {slo.describe()}"
                                if slo.items() else None))
    else:
        # A sweep's rows are named by their keys' columns (the point names are in sweep.csv).
        first = ["variant"] if kind == "compare" else json.loads((folder / "sweep.json").read_text())["keys"]
        extra = []
        if slo.items():
            for row, run in zip(rows, runs):
                row["goodput_req_s"] = str(plots.goodput(run, slo))
            extra = ["goodput_req_s"]
        # A feature's columns (speculative decoding, an offload tier, P/D) only where a
        # variant has them.
        shown = [c for c in COLUMNS[1:] if any(r.get(c) not in ("", None) for r in rows)]
        parts.append(_table(rows, [*first, *shown, *extra]))
    parts.append("<h2>Figures</h2>")
    parts += [_figure(p) for p in figures]
    parts.append("<h2>Scenario</h2>")
    if kind == "sweep":
        sweep = json.loads((folder / "sweep.json").read_text(encoding="utf-8"))
        parts.append(f"<p>{len(sweep['points'])} points over {', '.join(sweep['keys'])}. "
                     "Each point's resolved scenario:</p>")
    elif kind == "compare":
        parts.append("<p>Each variant's resolved scenario:</p>")
    for r in runs:
        parts.append(f"<details{' open' if kind == 'run' else ''}><summary>{html.escape(r.label)}"
                     f"</summary><pre>{html.escape(r.resolved_text)}</pre></details>")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>kvsim {title}: {html.escape(folder.resolve().name)}</title>"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><style>{CSS}</style>"
            f"</head><body><main>{''.join(parts)}</main></body></html>\n")


def write(folder: Path, out: Path, slo: plots.Goodput = plots.NO_SLO) -> None:
    """Write the report of ``folder`` to ``out``. Raises ConfigError for a non-result folder."""
    text = page(folder, slo)
    try:
        results.write_file(out, text)
    except OSError as exc:
        raise ConfigError(str(out), f"cannot write the report: {exc.strerror or exc}") from None
