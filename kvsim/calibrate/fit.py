"""Fit the step-time model of ``kvsim.cost.fitted`` to a CSV of measured steps; write a profile.

The CSV has one row per measured pass (``calibration/README.md`` documents the columns): the
batch (one prefill chunk of ``num_prefill_tokens`` after ``prefill_context`` tokens, plus
``num_decode_seqs`` sequences of ``decode_query_len`` tokens after ``decode_context`` each),
``num_sampled`` and the measured ``step_s``; ``pass`` is ``target`` or ``draft``. A random
fifth of the rows (seeded) is held out; the coefficients are fitted on the rest by
``scipy.optimize.least_squares`` on relative residuals, and the held-out rows give the error.
Imports numpy and scipy (runtime dependencies), never torch.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
from pathlib import Path

import numpy as np

from kvsim.cost.fitted import FORM, PARAMS, PROFILE_FORMAT, SHAPE_KEYS
from kvsim.errors import ConfigError

REQUIRED_COLUMNS = ("pass", "num_prefill_tokens", "prefill_context", "num_decode_seqs",
                    "decode_query_len", "decode_context", "num_sampled", "step_s")
# Provenance written on every row (the fit reads the model shape from them).
META_COLUMNS = ("source", "device", "torch_version", "dtype", "model", *SHAPE_KEYS,
                "tensor_parallel_size", "num_layers_timed")
PASSES = ("target", "draft")
HELDOUT_FRACTION = 0.2


def read_rows(path: Path) -> list[dict[str, str]]:
    """The CSV's rows as dicts. Raises ConfigError (no file, missing columns, no rows)."""
    where = str(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise ConfigError(where, f"missing columns: {', '.join(missing)}")
            rows = list(reader)
    except FileNotFoundError:
        raise ConfigError(where, "no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(where, f"cannot read the CSV: {exc}") from None
    if not rows:
        raise ConfigError(where, "no rows")
    return rows


def _columns(rows, where: str) -> dict[str, np.ndarray]:
    out = {}
    for c in REQUIRED_COLUMNS[1:]:
        try:
            out[c] = np.array([float(r[c]) for r in rows])
        except (TypeError, ValueError):
            bad = next(i for i, r in enumerate(rows) if not _is_number(r[c]))
            raise ConfigError(f"{where}:{bad + 2}", f"{c} must be a number, got {rows[bad][c]!r}") from None
    if (out["step_s"] <= 0).any():
        bad = int(np.argmax(out["step_s"] <= 0))
        raise ConfigError(f"{where}:{bad + 2}", f"step_s must be positive, got {rows[bad]['step_s']}")
    return out


def _is_number(v) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def feature_matrix(col: dict[str, np.ndarray], experts: tuple[int, int] = (0, 0)) -> np.ndarray:
    """The columns of ``kvsim.cost.fitted.features`` for every row: the prefill chunk is the
    row's prefill part, its decode sequences the decode part; ``experts`` is the model's
    ``(num_experts, num_experts_per_tok)``."""
    p, pc = col["num_prefill_tokens"], col["prefill_context"]
    nd, q, dc = col["num_decode_seqs"], col["decode_query_len"], col["decode_context"]
    has_p, has_d = (p > 0).astype(float), (nd > 0).astype(float)
    pure, mixed = 1 - has_p, has_p * has_d
    tokens = p + nd * q
    kv_decode = nd * (dc + q)
    num_experts, top_k = experts
    share = 1 - (1 - top_k / num_experts) ** tokens if num_experts else np.zeros(len(tokens))
    return np.stack([tokens, p * (pc + (p + 1) / 2), has_p * (pc + p), pure * kv_decode,
                     has_p * kv_decode, mixed * np.maximum(pc + p, dc + q), share, pure * nd,
                     mixed * (1 + nd), col["num_sampled"]], axis=1)


def predict(x: np.ndarray, feats: np.ndarray) -> np.ndarray:
    """Vectorised ``pass_time_s``: ``x`` in ``PARAMS`` order."""
    t0, w, p, a_tok, a_attn, a_kvp, a_kv, a_kvm, a_crit, q, a_moe, a_seq, a_seqm, a_lm = x
    tokens, pairs, kv_prefill, kv_pure, kv_mixed, longest, share, seqs_pure, seqs_mixed, rows = feats.T
    linear = (w ** p + (a_tok * tokens) ** p) ** (1 / p)
    attention = ((a_attn * pairs + a_kvp * kv_prefill + a_kvm * kv_mixed) ** q
                 + (a_crit * longest) ** q) ** (1 / q)
    return (t0 + linear + attention + a_kv * kv_pure + a_moe * share + a_seq * seqs_pure
            + a_seqm * seqs_mixed + a_lm * rows)


# Knee starting points tried for (p, q): the fit keeps the best.
KNEES = ((1.5, 2.0), (4.0, 2.0), (10.0, 4.0))


def _fit_params(feats: np.ndarray, y: np.ndarray, mean_unbiased: bool = False) -> np.ndarray:
    """Least squares on relative residuals, from a non-negative linear start, for a few knees;
    with ``mean_unbiased``, refined by plain least squares on the seconds themselves."""
    from scipy.optimize import least_squares, nnls

    # Linear start (p = q = 1, w = 0): t0, then one coefficient per feature column.
    lin = np.column_stack([np.ones(len(y)), feats]) / y[:, None]
    start, _ = nnls(lin, np.ones(len(y)))
    t0 = start[0]
    scale = np.maximum(np.abs(start), 1e-12)
    scale[0] = max(scale[0], float(np.median(y)) * 1e-3)
    lo, hi = np.zeros(len(PARAMS)), np.full(len(PARAMS), np.inf)
    for k in ("p", "q"):
        i = PARAMS.index(k)
        lo[i], hi[i] = 1.0, 32.0

    def resid(x):
        with np.errstate(over="ignore", invalid="ignore"):
            r = predict(x, feats) / y - 1
        return np.nan_to_num(r, nan=1e6, posinf=1e6)

    best = None
    for p0, q0 in KNEES:
        # PARAMS order: t0, w, p, then the feature coefficients with q after a_crit.
        x0 = np.array([t0 / 2, t0 / 2 + 1e-9, p0, *start[1:7], q0, *start[7:]])
        xs = np.array([scale[0], scale[0], 1.0, *scale[1:7], 1.0, *scale[7:]])
        free = np.ones(len(x0), bool)
        free[[PARAMS.index("p"), PARAMS.index("q")]] = False
        x0[free] = np.maximum(x0[free], 1e-15)
        r = least_squares(resid, x0, bounds=(lo, hi), x_scale=xs, loss="soft_l1", f_scale=0.05,
                          max_nfev=3000)
        if best is None or r.cost < best.cost:
            best = r
    assert best is not None  # at least one start
    if not mean_unbiased:
        return best.x
    r = least_squares(lambda x: predict(x, feats) - y, np.clip(best.x, lo + 1e-15, hi), bounds=(lo, hi),
                      x_scale=np.maximum(np.abs(best.x), 1e-12), max_nfev=3000)
    return r.x


def _errors_pct(x, feats, y) -> dict:
    err = np.abs(predict(x, feats) / y - 1) * 100
    return {"median_pct": round(float(np.median(err)), 2), "p90_pct": round(float(np.percentile(err, 90)), 2),
            "max_pct": round(float(err.max()), 2), "num_rows": int(len(y))}


def fit_pass(col: dict[str, np.ndarray], rng: np.random.Generator,
             experts: tuple[int, int] = (0, 0)) -> tuple[dict, dict | None, dict]:
    """Fit one pass's rows. Returns (params, held-out error, training error)."""
    return fit_features(feature_matrix(col, experts), col["step_s"], rng)


def fit_features(feats: np.ndarray, y: np.ndarray, rng: np.random.Generator,
                 mean_unbiased: bool = False) -> tuple[dict, dict | None, dict]:
    """Fit measured passes given as rows of ``kvsim.cost.fitted.features`` and seconds ``y``.

    The relative fit suits timed kernels (steady, errors in proportion). ``mean_unbiased``
    suits noisy, right-skewed times such as whole engine steps on a shared CPU: a latency is a
    sum of steps, so the fit should get the mean step right, not the median ratio.
    Returns (params, held-out error, training error)."""
    n = len(y)
    order = rng.permutation(n)
    num_held = int(round(n * HELDOUT_FRACTION)) if n >= 10 else 0
    held, train = order[:num_held], order[num_held:]
    x = _fit_params(feats[train], y[train], mean_unbiased)
    params = {k: float(v) for k, v in zip(PARAMS, x)}
    held_err = _errors_pct(x, feats[held], y[held]) if num_held else None
    return params, held_err, _errors_pct(x, feats[train], y[train])


def fit_rows(rows: list[dict[str, str]], where: str, seed: int = 0,
             experts: tuple[int, int] = (0, 0)) -> dict:
    """Fit every pass present in ``rows``. Returns ``{pass: (params, heldout, train, count)}``."""
    bad = {r["pass"] for r in rows} - set(PASSES)
    if bad:
        raise ConfigError(where, f"unknown pass {sorted(bad)[0]!r} (expected target or draft)")
    out = {}
    for name in PASSES:
        sel = [r for r in rows if r["pass"] == name]
        if not sel:
            continue
        if len(sel) < len(PARAMS) + 2:
            raise ConfigError(where, f"{len(sel)} {name} rows are too few to fit {len(PARAMS)} "
                              "coefficients")
        col = _columns(sel, where)
        params, held, train = fit_pass(col, np.random.default_rng(seed), experts)
        out[name] = (params, held, train, len(sel))
    if "target" not in out:
        raise ConfigError(where, "no target rows")
    return out


def model_meta(rows: list[dict[str, str]], where: str) -> dict:
    """Model shape, tensor parallel size and provenance, read from the CSV's columns."""
    first = rows[0]
    missing = [c for c in SHAPE_KEYS if c not in first]
    if missing:
        raise ConfigError(where, f"missing columns: {', '.join(missing)} (the model shape)")
    model: dict = {"name": first.get("model", "")}
    for k in SHAPE_KEYS:
        vals = {r[k] for r in rows}
        if len(vals) != 1:
            raise ConfigError(where, f"rows of several models ({k}: {', '.join(sorted(vals))})")
        try:
            model[k] = int(first[k])
        except ValueError:
            raise ConfigError(where, f"{k} must be an integer, got {first[k]!r}") from None
    return {"model": model, "tensor_parallel_size": int(first.get("tensor_parallel_size") or 1),
            "device": first.get("device", ""), "dtype": first.get("dtype", ""),
            "torch_version": first.get("torch_version", ""), "source": first.get("source", "")}


def build_profile(csv_path: Path, seed: int = 0, provenance: dict | None = None) -> dict:
    """Fit ``csv_path`` and return the profile (a JSON-ready dict). Raises ConfigError."""
    rows = read_rows(csv_path)
    where = str(csv_path)
    meta = model_meta(rows, where)
    fits = fit_rows(rows, where, seed,
                    (meta["model"]["num_experts"], meta["model"]["num_experts_per_tok"]))
    params, held, train, count = fits["target"]
    profile = {
        "format": PROFILE_FORMAT,
        **meta,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "form": FORM,
        "csv": csv_path.name,
        "num_points": {k: v[3] for k, v in fits.items()},
        "heldout_fraction": HELDOUT_FRACTION,
        "seed": seed,
        "heldout_error": held,
        "train_error": train,
        "target": params,
        "draft": fits["draft"][0] if "draft" in fits else None,
        "draft_heldout_error": fits["draft"][1] if "draft" in fits else None,
    }
    if provenance:
        profile["provenance"] = provenance
    return profile


def write_profile(profile: dict, out: Path) -> None:
    """Write ``profile`` as JSON to ``out`` (folders created). Raises ConfigError."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(out), f"cannot write the profile: {exc.strerror or exc}") from None


def write_csv(rows: list[dict], path: Path) -> None:
    """Write step rows: the provenance and required columns first, then any others."""
    cols = [*META_COLUMNS, *REQUIRED_COLUMNS]
    cols += [k for k in rows[0] if k not in cols] if rows else []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot write the CSV: {exc.strerror or exc}") from None


def summary_line(profile: dict) -> str:
    """One line of fit quality: held-out median and p90 absolute error, per pass."""
    parts = []
    for name, key in (("target", "heldout_error"), ("draft", "draft_heldout_error")):
        e = profile.get(key)
        if e:
            parts.append(f"{name}: held-out median {e['median_pct']:.1f} %, p90 {e['p90_pct']:.1f} % "
                         f"({e['num_rows']} of {profile['num_points'][name]} rows)")
    return "; ".join(parts)
