"""Measured vs predicted, request by request: the side-by-side CSV, error figures and plots.

Every validation target hands over the same per-request records (``req_id``, ``arrival_s``,
``prompt_tokens``, ``output_tokens``, ``cached_tokens``, ``ttft_s``, ``tpot_s``, ``e2e_s``,
times in seconds from the run's t = 0), one list measured and one predicted by kvsim, plus
which requests' cache hits cannot depend on timing (``timing_independent``).
"""

from __future__ import annotations

import csv
import io

import numpy as np

METRICS = (("ttft_s", "TTFT", 1e3, "ms"), ("tpot_s", "TPOT", 1e3, "ms"), ("e2e_s", "E2E", 1e3, "ms"))
PERCENTILES = (50, 90, 99)


def _common_blocks(a: tuple, b: tuple, block_size: int) -> int:
    """Full blocks two prompts share from their start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n // block_size


def timing_independent(measured: dict[str, dict], predicted: dict[str, dict],
                       prompts: dict[str, tuple], block_size: int, pressure: bool) -> set[str]:
    """Requests whose cache hit cannot depend on timing, judged from both runs.

    Request r's hit depends only on what finished before it arrived when every request that
    overlapped it (still running at its arrival, or arriving before its first token) shares no
    more leading blocks with it than some request that had finished by its arrival (a prefix
    warmed first), in both runs. Under cache pressure (more blocks written than the pool holds)
    eviction order could matter too, so only requests no other request overlapped (spaced apart)
    count.
    """
    out = None
    for run in (measured, predicted):
        ok = set()
        for rid, r in run.items():
            if r.get("ttft_s") is None:
                continue
            start, first = r["arrival_s"], r["arrival_s"] + r["ttft_s"]
            warmed, overlap = 0, 0.0
            for oid, o in run.items():
                if oid == rid:
                    continue
                o_end = o["arrival_s"] + o["e2e_s"] if o.get("e2e_s") is not None else float("inf")
                shared = _common_blocks(prompts[rid], prompts[oid], block_size)
                if o_end <= start:
                    warmed = max(warmed, shared)
                elif o["arrival_s"] < first:
                    overlap = max(overlap, shared if not pressure else float("inf"))
            if overlap <= warmed:
                ok.add(rid)
        out = ok if out is None else out & ok
    return out or set()


def side_by_side(measured: dict[str, dict], predicted: dict[str, dict], fixed: set[str]) -> list[dict]:
    rows = []
    for rid, m in sorted(measured.items(), key=lambda kv: kv[1]["arrival_s"]):
        p = predicted.get(rid, {})
        row = {"req_id": rid, "arrival_s": m["arrival_s"], "prompt_tokens": m["prompt_tokens"],
               "output_tokens": m["output_tokens"], "timing_independent": rid in fixed,
               "cached_tokens_measured": m.get("cached_tokens"),
               "cached_tokens_kvsim": p.get("cached_tokens")}
        for key, *_ in METRICS:
            row[f"{key}_measured"] = m.get(key)
            row[f"{key}_kvsim"] = p.get(key)
        # vLLM's own TTFT (from when the request reached the engine), where the target has it.
        row["vllm_first_token_latency_s"] = m.get("vllm_first_token_latency_s")
        rows.append(row)
    return rows


def abs_pct_errors(rows: list[dict], key: str) -> np.ndarray:
    pairs = [(r[f"{key}_measured"], r[f"{key}_kvsim"]) for r in rows
             if r[f"{key}_measured"] and r[f"{key}_kvsim"] is not None]
    return np.array([abs(p / m - 1) * 100 for m, p in pairs])


def throughput(records: list[dict]) -> float | None:
    """Output tokens per second from the first arrival to the last finish."""
    done = [r for r in records if r.get("e2e_s") is not None]
    if not done:
        return None
    start = min(r["arrival_s"] for r in records)
    end = max(r["arrival_s"] + r["e2e_s"] for r in done)
    return sum(r["output_tokens"] for r in done) / (end - start) if end > start else None


def summarize(rows: list[dict], measured: dict[str, dict], predicted: dict[str, dict]) -> dict:
    out: dict = {"num_requests": len(rows)}
    for group, sel in (("timing_independent", [r for r in rows if r["timing_independent"]]),
                       ("timing_dependent", [r for r in rows if not r["timing_independent"]])):
        exact = sum(r["cached_tokens_measured"] == r["cached_tokens_kvsim"] for r in sel)
        out[f"cached_exact_{group}"] = [exact, len(sel)]
    out["cached_mismatches"] = [
        {"req_id": r["req_id"], "timing_independent": r["timing_independent"],
         "measured": r["cached_tokens_measured"],
         "kvsim": r["cached_tokens_kvsim"]}
        for r in rows if r["cached_tokens_measured"] != r["cached_tokens_kvsim"]]
    for key, *_ in METRICS:
        err = abs_pct_errors(rows, key)
        meas = [r[f"{key}_measured"] for r in rows if r[f"{key}_measured"] is not None]
        pred = [r[f"{key}_kvsim"] for r in rows if r[f"{key}_kvsim"] is not None]
        out[key] = {
            "abs_pct_error": ({f"p{q}": float(np.percentile(err, q)) for q in PERCENTILES}
                              if len(err) else None),
            "measured": {f"p{q}": float(np.percentile(meas, q)) for q in PERCENTILES} if meas else None,
            "kvsim": {f"p{q}": float(np.percentile(pred, q)) for q in PERCENTILES} if pred else None,
        }
    tm, tp = throughput(list(measured.values())), throughput(list(predicted.values()))
    out["throughput_tok_s"] = {"measured": tm, "kvsim": tp,
                               "error_pct": (tp / tm - 1) * 100 if tm and tp else None}
    return out


def table(summary: dict) -> str:
    lines = []
    for group in ("timing_independent", "timing_dependent"):
        ok, n = summary[f"cached_exact_{group}"]
        rate = f"{100 * ok / n:.1f} %" if n else "-"
        label = group.replace("_", "-") + " requests:"
        lines.append(f"cached tokens exact, {label:27} {ok}/{n} ({rate})")
    for m in summary["cached_mismatches"][:5]:
        lines.append(f"  {m['req_id']}: measured {m['measured']}, kvsim {m['kvsim']}"
                     f"{' (timing-independent)' if m['timing_independent'] else ''}")
    lines.append(f"{'':6} {'measured p50/p90/p99':>24} {'kvsim p50/p90/p99':>24}   "
                 f"abs % error p50 / p90 / p99")
    for key, label, scale, unit in METRICS:
        s = summary[key]
        if s["abs_pct_error"] is None:
            lines.append(f"{label:6} -")
            continue

        meas, pred = (("/".join(f"{d[f'p{q}'] * scale:.1f}" for q in PERCENTILES) + f" {unit}")
                      for d in (s["measured"], s["kvsim"]))
        e = s["abs_pct_error"]
        lines.append(f"{label:6} {meas:>24} {pred:>24}   "
                     f"{e['p50']:.1f} / {e['p90']:.1f} / {e['p99']:.1f} %")
    t = summary["throughput_tok_s"]
    if t["error_pct"] is not None:
        lines.append(f"throughput: measured {t['measured']:.1f} tok/s, kvsim {t['kvsim']:.1f} tok/s "
                     f"({t['error_pct']:+.1f} %)")
    return "\n".join(lines)


def csv_text(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else f"{v:.9g}" if isinstance(v, float) else v)
                    for k, v in r.items()})
    return buf.getvalue()


def plot(rows: list[dict], folder, title: str) -> None:
    """``ttft_scatter.png`` (kvsim vs measured, per request) and ``cdf.png`` (TTFT, TPOT, E2E)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [(r["ttft_s_measured"] * 1e3, r["ttft_s_kvsim"] * 1e3, r["timing_independent"]) for r in rows
             if r["ttft_s_measured"] is not None and r["ttft_s_kvsim"] is not None]
    fig, ax = plt.subplots(figsize=(5, 5))
    for iso, color, label in ((True, "tab:blue", "hit timing-independent"),
                              (False, "tab:orange", "hit may depend on timing")):
        pts = [(m, p) for m, p, i in pairs if i == iso]
        if pts:
            measured, predicted = zip(*pts)
            ax.scatter(measured, predicted, s=14, color=color, label=label)
    if pairs:
        hi = max(max(m, p) for m, p, _ in pairs) * 1.05
        ax.plot([0, hi], [0, hi], color="grey", lw=0.8)
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
    ax.set_xlabel("measured TTFT (ms)")
    ax.set_ylabel("kvsim TTFT (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "ttft_scatter.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label, scale, unit) in zip(axes, METRICS):
        for who, color in (("measured", "black"), ("kvsim", "tab:blue")):
            v = np.sort([r[f"{key}_{who}"] * scale for r in rows if r[f"{key}_{who}"] is not None])
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=color, label=who)
        ax.set_xlabel(f"{label} ({unit})")
        ax.set_ylabel("fraction of requests")
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(folder / "cdf.png", dpi=110)
    plt.close(fig)
