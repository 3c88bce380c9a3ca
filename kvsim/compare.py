"""``kvsim compare``: a scenario's variants side by side, with a plain verdict.

Without ``--vary`` the variants are the 2×2 of speculative decoding (the scenario's own
``[speculative]`` method, or off) × prefix caching (on, off); a scenario without a method gets
the drafter its model supports (``default_drafter``: its own MTP layers, else EAGLE-3 with 3
drafts), and the comparison says so. With ``--vary section.key=v1,v2`` (repeatable) the variants
are the cartesian product of the given values; a variant that turns a method on without
``num_speculative_tokens`` gets it the same way. Each variant runs in full and
keeps its own result folder; the comparison is written as ``compare.csv`` and ``compare.png``.
"""

from __future__ import annotations

import csv
import io
import itertools
import re
from pathlib import Path

from kvsim import engine, metrics, overrides
from kvsim.config import parse_scenario
from kvsim.model import GiB, ModelCfg
from kvsim.workload import build_requests

COLUMNS = ("variant", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_mean_s", "requests_per_s",
           "output_tokens_per_s", "prefix_cache_hit_rate", "mean_cached_tokens", "num_preemptions",
           "mean_acceptance_length", "external_prefix_cache_hit_rate", "kv_offload_load_gib",
           "nixl_pulled_gib", "num_decode_only", "stopped_by")


# EAGLE-3's drafts per step when a comparison chooses it for a model without MTP layers.
EAGLE3_DRAFTS = 3


def default_drafter(model: ModelCfg) -> tuple[dict, str]:
    """The speculative decoding a model supports, as ``[speculative]`` keys, and why: its own
    MTP layers (vLLM's ``mtp``, one draft per layer), else EAGLE-3 with 3 drafts."""
    if model.num_nextn_predict_layers:
        k = model.num_nextn_predict_layers
        return ({"method": "mtp", "num_speculative_tokens": k},
                f"mtp with {k} draft{'s' * (k > 1)} (the model's own MTP layers)")
    return ({"method": "eagle3", "num_speculative_tokens": EAGLE3_DRAFTS},
            f"eagle3 with {EAGLE3_DRAFTS} drafts (the model has no MTP layers)")


def _model(raw: dict, path: Path) -> ModelCfg:
    return parse_scenario(overrides.apply(raw, "speculative", "method", "none"), path).model


def default_variants(raw: dict, path: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """The 2×2 and a note on the drafter when kvsim chose it."""
    notes = []
    method = raw.get("speculative", {}).get("method", "none")
    if method == "none":
        keys, why = default_drafter(_model(raw, path))
        for key, value in keys.items():
            raw = overrides.apply(raw, "speculative", key, value)
        method = keys["method"]
        notes.append(f"No method in [speculative]: comparing {why}; set one, or give --vary.")
    out = []
    for spec_on, cache_on in ((False, False), (False, True), (True, False), (True, True)):
        v = overrides.apply(raw, "engine", "enable_prefix_caching", cache_on)
        if not spec_on:
            v = overrides.apply(v, "speculative", "method", "none")
        name = {(False, False): "neither", (False, True): "prefix caching",
                (True, False): f"{method}", (True, True): f"{method} + prefix caching"}[spec_on, cache_on]
        out.append((name, v))
    return out, notes


def vary_variants(raw: dict, path: Path, specs: list[str]) -> tuple[list[tuple[str, dict]], list[str]]:
    """The variants of ``--vary`` and notes on the drafts kvsim filled in."""
    axes = [overrides.parse(s) for s in specs]
    out = []
    for combo in itertools.product(*[[(sec, key, v) for v in vals] for sec, key, vals in axes]):
        v = raw
        for sec, key, val in combo:
            v = overrides.apply(v, sec, key, val)
        # Label by the keys that actually vary (a one-value --vary just sets the key).
        parts = [overrides.label(key, val) for (sec, key, val), (_, _, vals) in zip(combo, axes)
                 if len(vals) > 1]
        out.append((" ".join(parts) or "as given", v))
    notes: list[str] = []
    for i, (name, v) in enumerate(out):
        spec = v.get("speculative", {})
        if spec.get("method", "none") != "none" and "num_speculative_tokens" not in spec:
            keys, why = default_drafter(_model(v, path))
            k = keys["num_speculative_tokens"] if spec["method"] == keys["method"] else EAGLE3_DRAFTS
            out[i] = (name, overrides.apply(v, "speculative", "num_speculative_tokens", k))
            note = f"num_speculative_tokens not given: {spec['method']} drafts {k} per step."
            if note not in notes:
                notes.append(note)
    return out, notes


def row(name: str, s: dict) -> dict:
    """One variant's line of the comparison, from its summary."""
    def q(d, k, scale=1.0):
        return None if d is None else d[k] * scale
    sd = s.get("spec_decode") or {}
    ko = s.get("kv_offload") or {}
    pd = s.get("pd") or {}
    return {
        "variant": name,
        "ttft_p50_ms": q(s["ttft_s"], "p50", 1e3), "ttft_p99_ms": q(s["ttft_s"], "p99", 1e3),
        "tpot_p50_ms": q(s["tpot_s"], "p50", 1e3), "e2e_mean_s": q(s["e2e_s"], "mean"),
        "requests_per_s": s["throughput"]["requests_per_s"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
        "mean_cached_tokens": s["cached_tokens_mean"],
        "num_preemptions": s["num_preemptions"],
        "mean_acceptance_length": sd.get("mean_acceptance_length"),
        "external_prefix_cache_hit_rate": ko.get("external_prefix_cache_hit_rate"),
        "kv_offload_load_gib": (ko["kv_offload_load_bytes"] / GiB if ko else None),
        # P/D: what the decode instances read from the prefill instances, and the requests
        # the decider sent to a decode instance alone.
        "nixl_pulled_gib": pd["nixl_bytes_transferred"] / GiB if pd else None,
        "num_decode_only": pd["num_decode_only"] if pd else None,
        # A run cut short (a limit, vLLM's own deadlock or engine death): its figures cover
        # only the requests that finished before.
        "stopped_by": s["stopped_by"], "stop_detail": s.get("stop_detail"),
        "num_finished": s["num_finished"], "num_requests": s["num_requests"],
    }


def run_variants(raw: dict, path: Path, variants: list[tuple[str, dict]]):
    """Validate every variant first (a bad one fails before anything runs), then run them."""
    scenarios = [(name, parse_scenario(v, path)) for name, v in variants]
    results = []
    for name, sc in scenarios:
        rec = engine.run(sc, build_requests(sc))
        results.append((name, sc, rec, metrics.summarize(sc, rec)))
    return results


def verdict(rows: list[dict], default: bool) -> list[str]:
    """Plain sentences: does the combination beat each feature alone (by mean E2E latency)?
    A run cut short is named and left out of the comparisons."""
    lines = [cut_short(r) for r in rows if r["stopped_by"]]
    if not default or len(rows) != 4 or lines:
        best = min((r for r in rows if r["e2e_mean_s"] is not None and not r["stopped_by"]),
                   key=lambda r: r["e2e_mean_s"], default=None)
        return lines + ([f"Lowest mean E2E latency: {best['variant']} ({best['e2e_mean_s']:.3f} s)."]
                        if best else [])
    _, cache, spec, both = rows
    for alone in (cache, spec):
        if both["e2e_mean_s"] is None or alone["e2e_mean_s"] is None:
            continue
        change = 100 * (both["e2e_mean_s"] / alone["e2e_mean_s"] - 1)
        word = "beats" if change < 0 else "does not beat"
        line = (f"{both['variant']} {word} {alone['variant']} alone on mean E2E: "
                f"{both['e2e_mean_s']:.3f} s vs {alone['e2e_mean_s']:.3f} s ({change:+.1f} %)")
        if both["ttft_p50_ms"] is not None and alone["ttft_p50_ms"]:
            ttft = 100 * (both["ttft_p50_ms"] / alone["ttft_p50_ms"] - 1)
            # The other latency said too, and "but" where it moves the other way.
            joint = "but" if (ttft > 0) == (change < 0) and abs(ttft) >= 1 else "and"
            line += (f", {joint} TTFT p50 {both['ttft_p50_ms']:.1f} vs {alone['ttft_p50_ms']:.1f} ms "
                     f"({ttft:+.1f} %)")
        lines.append(line + ".")
    if cache["mean_cached_tokens"] and both["mean_cached_tokens"] is not None:
        lost = cache["mean_cached_tokens"] - both["mean_cached_tokens"]
        if lost > 0:
            lines.append(f"Speculative decoding cut the mean prefix-cache hit by {lost:,.0f} tokens "
                         f"({cache['mean_cached_tokens']:,.0f} -> {both['mean_cached_tokens']:,.0f}).")
    return lines


def cut_short(r: dict) -> str:
    """A sentence on a variant whose run stopped before its last request finished."""
    why = {"engine_dead": f"vLLM's engine core dies ({r['stop_detail']})",
           "stall": "vLLM deadlocks (the head of the waiting queue can never be admitted)"}.get(
        r["stopped_by"], f"run.{r['stopped_by']} cut the run")
    return (f"{r['variant']}: {why} after {r['num_finished']} of {r['num_requests']} requests "
            "finished; its figures cover those only, and it is left out of the comparison.")


def table(rows: list[dict], first: str = "variant") -> str:
    heads: tuple[str, ...] = (first, "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "E2E mean s",
                              "req/s", "hit rate %", "mean hit", "preempt", "accept len")
    keys: tuple[str, ...] = (first, "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_mean_s",
                             "requests_per_s", "prefix_cache_hit_rate", "mean_cached_tokens",
                             "num_preemptions", "mean_acceptance_length")
    if any(r.get("kv_offload_load_gib") is not None for r in rows):  # a CPU offload tier
        heads += ("CPU hit %", "loaded GiB")
        keys += ("external_prefix_cache_hit_rate", "kv_offload_load_gib")
    if any(r.get("nixl_pulled_gib") is not None for r in rows):  # P/D instances
        heads += ("pulled GiB", "decode-only")
        keys += ("nixl_pulled_gib", "num_decode_only")
    width = max(len(heads[0]), *(len(r[first]) for r in rows))

    def cell(k, v):
        if v is None:
            return "-"
        if k in ("prefix_cache_hit_rate", "external_prefix_cache_hit_rate"):
            return f"{100 * v:.1f}"
        if k in ("mean_cached_tokens",):
            return f"{v:,.0f}"
        return f"{v:.2f}" if isinstance(v, float) else str(v)
    lines = [f"{heads[0]:<{width}}" + "".join(f"{h:>12}" for h in heads[1:])]
    for r in rows:
        lines.append(f"{r[first]:<{width}}" + "".join(f"{cell(k, r[k]):>12}" for k in keys[1:]))
    return "\n".join(lines)


def csv_text(rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r[c] is None else (f"{r[c]:.9g}" if isinstance(r[c], float) else r[c])
                    for c in columns])
    return buf.getvalue()


def plot(rows: list[dict], png: Path, cost_labels: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    panels = (("TTFT p50 / p99 (ms)", ("ttft_p50_ms", "ttft_p99_ms")),
              ("TPOT p50 (ms)", ("tpot_p50_ms",)), ("Output tokens/s", ("output_tokens_per_s",)),
              ("Mean cached tokens per request", ("mean_cached_tokens",)))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, panels):
        width = 0.8 / len(keys)
        for j, k in enumerate(keys):
            vals = [r[k] or 0 for r in rows]
            ax.bar([i + j * width for i in range(len(rows))], vals, width, label=k)
        ax.set_title(title)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(rows))], names,
                      rotation=20, ha="right", fontsize=8)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    labels = sorted(set(cost_labels))
    fig.suptitle("kvsim compare · cost model: " + (labels[0] if len(labels) == 1 else
                                                    "per variant (" + "; ".join(labels) + ")"))
    fig.savefig(png, dpi=110)
    fig.savefig(png.with_suffix(".svg"))
    plt.close(fig)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", name).strip("_") or "variant"

