"""Step times interpolated in vLLM's own layer profiles, beside the fitted form.

A layer-profile folder (LLMServingSim's format, ``profiles/<hardware>/<org>/<model>/<variant>/``:
``meta.yaml`` and one ``tp<N>/`` per tensor parallel size) holds vLLM's own kernels timed on a
one-layer model: ``attention.csv`` (prefill chunk, its KV context, decode count, decode context
-> µs), ``dense.csv`` (per layer type x tokens -> µs), ``per_sequence.csv`` (``lm_head``,
``sampler`` x sequences -> µs) and, for an MoE model, ``moe.csv`` (tokens x activated experts
-> µs). One pass over ``L`` layers, ``T`` tokens and ``S`` LM-head rows is composed as::

    L · (attention + Σ per-layer dense ops(T) + the second layernorm(T) [+ fused MoE(T)])
      + embedding(T) + final_layernorm(T) + lm_head(S) + sampler(S)

Each table is interpolated linearly (the peer's leave-one-out check found linear blending
closer than log-space on these doubling grids). The attention grid is irregular (each
(chunk, decode count) slice has its own contexts), so it is interpolated one axis at a time:
chunk, then decode count, then prefill context, then decode context. The fused-MoE time is
taken at the experts ``T`` tokens are expected to activate under uniform top-k routing,
``N·(1 − (1 − k/N)^T)`` (linear in the expert count, then in tokens).

A step maps onto the grid so: its decode chunks (at most ``1 + num_speculative_tokens``
tokens, vLLM's decode path) count as ``n_decode`` at their mean context, which keeps the KV
they read; its first prefill chunk runs with them; each further prefill chunk is its own
lookup less the kernel's launch floor (the least attention time profiled), as one
variable-length launch runs them all.

Outside the grid (a longer chunk or context, more decodes than profiled, more tokens than
``dense.csv``), the step is the fitted form's (``kvsim.cost.fitted``, fitted to the same
folder's composed rows, as ``kvsim calibrate --from llmservingsim`` does) scaled to agree with
the interpolation at the nearest step inside the grid: the fitted form extrapolates, the
profile anchors it. A drafter's pass (EAGLE/MTP head) is the same composition with ``L = 1``.
"""

from __future__ import annotations

import csv
import functools
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsim.cost.base import CostInputs, Decodes, drafter_passes
from kvsim.cost.comm import AllReduce
from kvsim.cost.fitted import SHAPE_KEYS, check_matches, expert_share, features, lm_head_rows, pass_time_s
from kvsim.errors import ConfigError
from kvsim.model import ModelCfg

# Ops applied once per step rather than once per layer.
ONCE_PER_STEP = ("embedding", "final_layernorm")
# Rows per pass the extrapolating fitted form is fitted to (held-out median error as with all).
FIT_ROWS = 4000
ATTENTION_COLUMNS = ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode", "time_us")


def _bracket(xs: Sequence[float], x: float) -> tuple[tuple[int, float], ...]:
    """Indices and weights of ``x`` between its neighbours in ascending ``xs``: clamped below
    the first; past the last, on the line through the last two (the kernels are linear in
    each axis there: KV read, tokens, decodes)."""
    n = len(xs)
    if x <= xs[0] or n == 1:
        return ((0, 1.0),)
    i = min(bisect_right(xs, x), n - 1)
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ((i - 1, 1.0 - w), (i, w))


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    return sum(w * ys[i] for i, w in _bracket(xs, x))


# One (chunk, decode count) slice of the attention grid: prefill contexts, and per context
# the decode contexts and their µs.
_KpSlice = tuple[list[float], list[tuple[list[float], list[float]]]]


@dataclass(frozen=True, slots=True)
class GridStep:
    """A pass in the profile's terms: prefill chunks ``(n, c)``, ``num_decodes`` decode chunks
    reading ``decode_kv`` KV entries in all (``longest`` and ``shortest`` the most and the
    least one reads), ``tokens`` through the layers and ``rows`` through the LM head."""

    prefills: tuple[tuple[float, float], ...]
    num_decodes: int
    decode_kv: float
    longest: float
    shortest: float
    tokens: float
    rows: float

    @staticmethod
    def of(chunks, num_rows: int, max_decode_len: int, decodes: Decodes | None = None) -> GridStep:
        """The pass over ``chunks`` (pairs ``(n, c)``) and ``decodes`` (further decode chunks
        as ``Decodes``) with ``num_rows`` LM-head rows."""
        count, length, kv, longest, shortest = (decodes if decodes is not None
                                                else (0, 0, 0, 0, math.inf))
        tokens = float(count * length)
        prefills = []
        for n, c in chunks:
            tokens += n
            if n > max_decode_len:
                prefills.append((n, c))
            else:
                count += 1
                kv += c + n
                longest = max(longest, c + n)
                shortest = min(shortest, c + n)
        return GridStep(tuple(prefills), count, float(kv), float(longest),
                        float(shortest) if count else 0.0, tokens, float(num_rows))

    def fitted_s(self, params: dict[str, float], experts: tuple[int, int]) -> float:
        """The fitted form's seconds for this pass."""
        decodes = ((self.num_decodes, 1, self.decode_kv, self.longest, self.shortest)
                   if self.num_decodes else None)  # (the fitted form's decodes: one token)
        return pass_time_s(params, features(self.prefills, int(self.rows), 1, experts, decodes))


class LayerProfile:
    """One tensor parallel size's layer tables from a profile folder, composed into passes.

    ``keep`` selects ``attention.csv``'s rows (by index) to build from: the held-out
    comparison leaves the others out."""

    def __init__(self, folder: Path, tp: int, model: ModelCfg, keep=None):
        tree = _read_yaml(folder)
        self.meta = _scalars(tree)
        sub = folder / f"tp{tp}"
        if not sub.is_dir():
            raise ConfigError(str(sub), f"no profile for tensor_parallel_size {tp} (profiled: "
                              f"{', '.join(map(str, tp_degrees(folder))) or 'none'})")
        self.model = model
        self.experts = (model.num_experts, model.num_experts_per_tok)
        dense = _table(sub / "dense.csv", "tokens")
        per_seq = _table(sub / "per_sequence.csv", "sequences")
        for op in ("lm_head", "sampler"):
            if op not in per_seq:
                raise ConfigError(str(sub / "per_sequence.csv"), f"no {op!r} rows")
        for op in ("layernorm", *ONCE_PER_STEP):
            if op not in dense:
                raise ConfigError(str(sub / "dense.csv"), f"no {op!r} rows")
        # Per layer: every per-layer op, the layernorm twice (before attention and the MLP).
        self.layer_xs, self.layer_ys = _sum_tables(
            [dense[op] for op in dense if op not in ONCE_PER_STEP] + [dense["layernorm"]])
        self.once_xs, self.once_ys = _sum_tables([dense[op] for op in ONCE_PER_STEP])
        self.head_xs, self.head_ys = _sum_tables([per_seq["lm_head"], per_seq["sampler"]])
        self.max_tokens = min(xs[-1] for xs, _ in dense.values())
        self.max_rows = self.head_xs[-1]
        self.moe: dict[float, tuple[list[float], list[float]]] | None = None
        if model.num_experts:
            self.moe = _moe_table(sub / "moe.csv")
            self.moe_tokens = sorted(self.moe)
        elif (sub / "moe.csv").exists():
            raise ConfigError(str(sub), f"moe.csv profiles an MoE model, but {model.name!r} has "
                              "no num_experts")
        self._read_attention(sub / "attention.csv", keep)
        self.skew = SkewFit.read(folder, tree, tp)

    def _read_attention(self, path: Path, keep) -> None:
        rows = _read_csv(path, ATTENTION_COLUMNS)
        if keep is not None:
            rows = [rows[i] for i in sorted(keep)]
        if not rows:
            raise ConfigError(str(path), "no rows")
        self.points = rows  # (pc, kp, nd, kd, µs), as read
        slices: dict[float, dict[float, dict[float, list[tuple[float, float]]]]] = {}
        for pc, kp, nd, kd, us in rows:
            slices.setdefault(pc, {}).setdefault(nd, {}).setdefault(kp, []).append((kd, us))
        # pc -> (decode counts, per count (prefill contexts, per context (contexts, µs)))
        self.att: dict[float, tuple[list[float], list[_KpSlice]]] = {}
        for pc, by_nd in slices.items():
            nds = sorted(by_nd)
            per_nd = []
            for nd in nds:
                kps = sorted(by_nd[nd])
                per_nd.append((kps, [_sorted_xy(by_nd[nd][kp]) for kp in kps]))
            self.att[pc] = (nds, per_nd)
        self.pcs = sorted(self.att)
        self.floor_us = min(r[4] for r in rows)
        # The grid's edges: what a step is clamped to before the fitted form extrapolates.
        self.max_chunk = max(r[0] for r in rows)
        self.max_prefill_context = max(r[1] for r in rows)
        self.max_decode_context = max(r[3] for r in rows)
        self.max_decodes_alone = max((r[2] for r in rows if r[0] == 0), default=0.0)
        self.max_decodes_mixed = max((r[2] for r in rows if r[0] > 0), default=0.0)

    # -- the tables ----------------------------------------------------------------------

    def attention_us(self, pc: float, kp: float, nd: float, kd: float) -> float:
        """One layer's attention over one prefill chunk of ``pc`` tokens after ``kp`` and
        ``nd`` decodes at context ``kd``, interpolated axis by axis."""
        total = 0.0
        for i, wi in _bracket(self.pcs, pc):
            nds, per_nd = self.att[self.pcs[i]]
            for j, wj in _bracket(nds, nd):
                kps, per_kp = per_nd[j]
                for k, wk in _bracket(kps, kp):
                    xs, ys = per_kp[k]
                    total += wi * wj * wk * _interp(xs, ys, kd)
        return total

    def moe_us(self, tokens: float, ranks: int = 1) -> float:
        """One MoE layer's fused-MoE time for ``tokens`` tokens (0 for a dense model) on a
        ``1/ranks`` share of the experts: the experts they activate there, and their routed
        rows, ``1/ranks`` of all (the kernel's fixed cost is each rank's own)."""
        if self.moe is None or tokens <= 0:
            return 0.0
        activated = self.model.num_experts * expert_share(tokens, *self.experts) / ranks
        grid = self.moe_tokens
        return sum(w * _interp(*self.moe[grid[i]], activated)
                   for i, w in _bracket(grid, tokens / ranks))

    def decode_attention_us(self, pc: float, kp: float, step: GridStep) -> float:
        """``attention_us`` with ``step``'s decodes: at their mean context, and, when their
        contexts differ, moved toward the time at the longest by the profile's skew fit
        (``t_mean + α·(t_max − t_mean)``, α by bucket; a varlen kernel's tiles and SMs are
        less evenly loaded than a uniform batch's)."""
        nd = step.num_decodes
        if not nd:
            return self.attention_us(pc, kp, 0, 0)
        # contexts before each decode's own token
        mean, longest, shortest = step.decode_kv / nd - 1, step.longest - 1, step.shortest - 1
        t_mean = self.attention_us(pc, kp, nd, mean)
        if nd < 2 or self.skew is None or longest <= mean:
            return t_mean
        rate = (mean - shortest) / (longest - shortest) if longest > shortest else 0.5
        alpha = self.skew.alpha(pc, nd, rate, longest, kp)
        t_max = self.attention_us(pc, kp, nd, longest)
        return t_mean + alpha * (t_max - t_mean) if t_max > t_mean else t_mean

    def pass_us(self, step: GridStep, num_layers: int) -> float:
        """Microseconds of one pass of ``num_layers`` layers over ``step`` (inside the grid)."""
        first, *rest = step.prefills or ((0.0, 0.0),)
        attention = self.decode_attention_us(first[0], first[1], step)
        for n, c in rest:
            attention += self.attention_us(n, c, 0, 0) - self.floor_us
        t = step.tokens
        per_layer = attention + _interp(self.layer_xs, self.layer_ys, t) + self.moe_us(t)
        return (num_layers * per_layer + _interp(self.once_xs, self.once_ys, t)
                + _interp(self.head_xs, self.head_ys, step.rows))

    def clamp(self, step: GridStep) -> GridStep:
        """``step`` moved to the nearest step inside the profiled grid (itself if inside)."""
        prefills = tuple((min(n, self.max_chunk), min(c, self.max_prefill_context))
                         for n, c in step.prefills)
        nd = step.num_decodes
        most = self.max_decodes_mixed if prefills else self.max_decodes_alone
        num_decodes = int(min(nd, most))
        decode_tokens = step.tokens - sum(n for n, _ in step.prefills)
        kv = longest = shortest = decode_tokens_in = 0.0
        if num_decodes:
            edge = self.max_decode_context + 1
            kv = num_decodes * min(step.decode_kv / nd, edge)
            longest, shortest = min(step.longest, edge), min(step.shortest, edge)
            decode_tokens_in = decode_tokens * num_decodes / nd
        prefill_tokens = sum(n for n, _ in prefills)
        room = self.max_tokens - decode_tokens_in
        if prefill_tokens > room:  # more tokens than the dense ops were profiled for
            scale = max(room, 0.0) / prefill_tokens
            prefills = tuple((max(1.0, math.floor(n * scale)), c) for n, c in prefills)
            prefill_tokens = sum(n for n, _ in prefills)
        inside = GridStep(prefills, num_decodes, kv, longest, shortest,
                          prefill_tokens + decode_tokens_in, min(step.rows, self.max_rows))
        return step if inside == step else inside

    @staticmethod
    def grid_step(pc: float, kp: float, nd: float, kd: float) -> GridStep:
        """The one-chunk pass of an attention grid point: one prefill chunk of ``pc`` tokens
        after ``kp``, ``nd`` decodes at context ``kd``, one LM-head row per sequence."""
        length = kd + 1 if nd else 0.0
        return GridStep(((pc, kp),) if pc else (), int(nd), nd * length, length, length,
                        pc + nd, nd + (pc > 0))

    def grid_steps(self) -> list[GridStep]:
        """Every attention grid point's pass: the rows ``kvsim calibrate --from llmservingsim``
        fits (past ``dense.csv``'s tokens dropped)."""
        return [self.grid_step(pc, kp, nd, kd) for pc, kp, nd, kd, _ in self.points
                if 0 < pc + nd <= self.max_tokens]


class InterpolatedCost:
    """Step times interpolated in a layer-profile folder (same interface as ``FittedCost``)."""

    def __init__(self, inp: CostInputs):
        if inp.layer_profile is None:
            raise ConfigError("cost.model", "'interpolated' needs cost.layer_profile")
        model, d = inp.model, inp.drafter
        self.layers, fit = _load(inp.layer_profile, inp.tensor_parallel_size, model)
        self.fit_target, self.fit_draft = fit["target"], fit.get("draft")
        self.max_decode_len = 1 + d.num_passes
        self.experts = (model.num_experts, model.num_experts_per_tok)
        self.allreduce = AllReduce(inp)
        self.num_layers = model.num_hidden_layers
        self.overhead_s = inp.step_overhead_s
        if d.method == "draft_model":
            raise ConfigError("cost.layer_profile", "a layer profile has no draft-model pass; use "
                              "the roofline for method = 'draft_model'")
        self.num_draft_passes = d.num_passes if d.method not in ("none", "ngram") else 0
        meta = self.layers.meta
        self.label = (f"interpolated ({meta.get('gpu', '?')}, vLLM {meta.get('vllm_version', '?')} "
                      f"layer profiles, tp {inp.tensor_parallel_size})")

    def _pass_s(self, step: GridStep, num_layers: int, params: dict[str, float]) -> float:
        layers = self.layers
        inside = layers.clamp(step)
        seconds = 1e-6 * layers.pass_us(inside, num_layers)
        if inside is not step:  # past the grid: the fitted form, anchored at its edge
            seconds *= step.fitted_s(params, self.experts) / inside.fitted_s(params, self.experts)
        return seconds + self.allreduce.time_s(step.tokens, num_layers)

    def step_time_s(self, chunks, num_sampled: int, decodes: Decodes | None = None) -> float:
        """Seconds for the target model's step over ``chunks`` (pairs ``(n, c)``) and
        ``decodes`` (further chunks as ``Decodes``)."""
        rows = lm_head_rows(chunks, num_sampled, self.max_decode_len, decodes)
        step = GridStep.of(chunks, rows, self.max_decode_len, decodes)
        return self.overhead_s + self._pass_s(step, self.num_layers, self.fit_target)

    def moe_time_s(self, tokens: float, ranks: int = 1) -> float:
        """All MoE layers' fused-MoE time for ``tokens`` tokens on a ``1/ranks`` share of the
        experts (``moe.csv`` past its tokens: linear in them, from its last two rows)."""
        return 1e-6 * self.num_layers * self.layers.moe_us(tokens, ranks)

    def draft_time_s(self, chunks, num_sampled: int, decodes: Decodes | None = None) -> float:
        """Seconds the drafter adds: one pass over the step's chunks, then k − 1 one-row passes."""
        if not self.num_draft_passes or not num_sampled:
            return 0.0
        assert self.fit_draft is not None  # every profile folder composes a drafter pass
        (first, rows), (rest, rest_rows) = drafter_passes(chunks, num_sampled, decodes)
        seconds = self._pass_s(GridStep.of(first, rows, self.max_decode_len, decodes), 1,
                               self.fit_draft)
        if self.num_draft_passes > 1:
            seconds += (self.num_draft_passes - 1) * self._pass_s(
                GridStep.of(rest, rest_rows, 1), 1, self.fit_draft)
        return seconds


# -- reading a profile folder ------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _load_cached(folder: str, stamp: float, tp: int, model: ModelCfg) -> tuple[LayerProfile, dict]:
    import numpy as np

    from kvsim.calibrate import fit  # numpy and scipy: only when a layer profile is used

    layers = LayerProfile(Path(folder), tp, model)
    rows = composed_rows(layers, {})
    rng = np.random.default_rng(0)
    sample = []
    for name in fit.PASSES:  # a seeded sample fits as well as every row, in a tenth the time
        sel = [r for r in rows if r["pass"] == name]
        picked = rng.choice(len(sel), min(len(sel), FIT_ROWS), replace=False)
        sample += [sel[i] for i in sorted(picked)]
    fits = fit.fit_rows(sample, folder, 0, layers.experts)
    return layers, {name: v[0] for name, v in fits.items()}


def _load(folder: Path, tp: int, model: ModelCfg) -> tuple[LayerProfile, dict]:
    """The folder's tables and the fitted form fitted to its composed rows (kept per process:
    every engine of a run, every run of a sweep, reads the same folder once)."""
    stamp = max((p.stat().st_mtime for p in (folder / f"tp{tp}").glob("*.csv")), default=0.0)
    return _load_cached(str(folder.resolve()), stamp, tp, model)


def composed_rows(layers: LayerProfile, common: dict) -> list[dict]:
    """CSV-ready target and draft rows of every grid point (``common`` added to each)."""
    out = []
    for pass_name, num_layers in (("target", layers.model.num_hidden_layers), ("draft", 1)):
        for step in layers.grid_steps():
            (pc, kp), = step.prefills or ((0, 0),)
            nd = step.num_decodes
            out.append({**common, "pass": pass_name, "num_prefill_tokens": int(pc),
                        "prefill_context": int(kp), "num_decode_seqs": nd, "decode_query_len": 1,
                        "decode_context": int(step.decode_kv / nd - 1) if nd else 0,
                        "num_sampled": int(step.rows),
                        "step_s": f"{layers.pass_us(step, num_layers) * 1e-6:.9g}"})
    return out


def check_model(folder: Path, model: ModelCfg, tp: int, where: str) -> None:
    """Raise ConfigError unless the folder profiles ``model``'s shape (by the kvsim preset of
    the profiled model; without one, unless the two name different models)."""
    from kvsim import presets
    from kvsim.config import model_preset

    hf_model = read_meta(folder).get("model", "")
    name = presets.by_hf_id(hf_model, ignore_instruct=True)
    if name is None:  # no shape to check against: only a differently named model is refused
        if hf_model and model.hf_id and presets.hf_key(hf_model) != presets.hf_key(model.hf_id):
            raise ConfigError(where, f"the profile is for {hf_model!r}, the scenario's model is "
                              f"{model.hf_id!r}")
        return
    shape = model_preset(name)
    profile = {"model": {"name": name, **{k: getattr(shape, k) for k in SHAPE_KEYS}},
               "tensor_parallel_size": tp}
    check_matches(profile, model, tp, where)


class SkewFit:
    """LLMServingSim's skew fit of one tensor parallel size (``meta.yaml``'s ``skew_fit``,
    its ``per_tp`` entry and ``tp<N>/skew_fit.csv``): α by bucket of (prefill chunk, decode
    count, skew rate, longest decode context, prefill context), else ``alpha_default``."""

    AXES = ("n", "skew_rate", "kv_big", "kp")

    def __init__(self, axes: dict[str, tuple[list[float], list[str]]], alphas: dict[tuple, float],
                 default: float):
        self.axes, self.alphas, self.default = axes, alphas, default
        self.chunks = sorted({k[0] for k in alphas}) or [0.0]

    @staticmethod
    def read(folder: Path, tree: dict, tp: int) -> SkewFit | None:
        block = tree.get("skew_fit")
        if not isinstance(block, dict) or not block.get("enabled"):
            return None
        where = str(folder / "meta.yaml")
        per_tp = block.get("per_tp") or {}
        entry = per_tp.get(tp) or per_tp.get(str(tp))
        if not isinstance(entry, dict):
            return None
        raw = entry.get("bucket_axes") or block.get("bucket_axes")
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: skew_fit", "needs bucket_axes (n, skew_rate, kv_big, kp "
                              "bins and labels)")
        try:
            axes = {a: ([float(b) for b in raw[f"{a}_bins"]], [str(v) for v in raw[f"{a}_labels"]])
                    for a in SkewFit.AXES}
            default = float(entry.get("alpha_default", 0.0))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{where}: skew_fit", "needs bucket_axes (n, skew_rate, kv_big, kp "
                              "bins and labels) and a numeric alpha_default") from None
        alphas: dict[tuple, float] = {}
        table = entry.get("bucket_table")
        if table:
            path = folder / str(table)
            try:
                with open(path, newline="", encoding="utf-8") as f:
                    for line, r in enumerate(csv.DictReader(f), start=2):
                        try:
                            key = (float(r["pc"]), r["n_label"], r["skew_rate_label"],
                                   r["kv_big_label"], r["kp_label"])
                            alphas[key] = float(r["alpha"])
                        except (KeyError, TypeError, ValueError):
                            raise ConfigError(f"{path}:{line}", "expected pc, n_label, "
                                              "skew_rate_label, kv_big_label, kp_label, alpha") from None
            except FileNotFoundError:
                raise ConfigError(str(path), "no such file (meta.yaml's skew_fit bucket_table)") from None
        return SkewFit(axes, alphas, default)

    def _label(self, axis: str, value: float) -> str:
        bins, labels = self.axes[axis]
        return next((labels[i] for i in range(len(labels)) if value <= bins[i + 1]), labels[-1])

    def alpha(self, pc: float, n: float, rate: float, kv_big: float, kp: float) -> float:
        """α of a batch; ``pc`` is bucketed at the nearest profiled chunk (on a doubling scale)."""
        chunk = min(self.chunks, key=lambda p: abs(math.log((pc + 1) / (p + 1))))
        key = (chunk, self._label("n", n), self._label("skew_rate", min(max(rate, 0.0), 1.0)),
               self._label("kv_big", kv_big), self._label("kp", kp))
        return self.alphas.get(key, self.default)


def read_meta(folder: Path) -> dict[str, str]:
    """Top-level scalar keys of ``meta.yaml`` (model, gpu, vllm_version, ...), as text."""
    return _scalars(_read_yaml(folder))


def _scalars(tree: dict) -> dict[str, str]:
    return {str(k): str(v) for k, v in tree.items() if not isinstance(v, dict | list)}


def _read_yaml(folder: Path) -> dict:
    """``meta.yaml`` of a profile folder. Raises ConfigError."""
    import yaml

    path = folder / "meta.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(str(folder), "no meta.yaml (expected an LLMServingSim profile folder "
                          "profiles/<hardware>/<org>/<model>/<variant>)") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"cannot read it: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "must be a YAML mapping of keys to values")
    return data


def tp_degrees(folder: Path) -> list[int]:
    """The tensor parallel sizes profiled in ``folder`` (its ``tp<N>`` subfolders)."""
    return sorted(int(p.name[2:]) for p in folder.glob("tp[0-9]*") if p.is_dir() and p.name[2:].isdigit())


def _read_csv(path: Path, columns: Sequence[str]) -> list[tuple[float, ...]]:
    """The numeric ``columns`` of every row of ``path``. Raises ConfigError naming the line."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in columns if c not in (reader.fieldnames or ())]
            if missing:
                raise ConfigError(str(path), f"missing columns: {', '.join(missing)} (expected "
                                  f"{', '.join(columns)})")
            out = []
            for line, r in enumerate(reader, start=2):
                try:
                    row = tuple(float(r[c]) for c in columns)
                except (TypeError, ValueError):
                    raise ConfigError(f"{path}:{line}", f"expected numbers in {', '.join(columns)}") from None
                if any(v < 0 or v != v for v in row):
                    raise ConfigError(f"{path}:{line}", "values must be non-negative numbers")
                out.append(row)
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from None
    return out


def _table(path: Path, key: str) -> dict[str, tuple[list[float], list[float]]]:
    """``{op: (sizes, µs)}`` of a dense/per-sequence CSV, sorted by size."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            need = ("layer", key, "time_us")
            if any(c not in (reader.fieldnames or ()) for c in need):
                raise ConfigError(str(path), f"missing columns (expected {', '.join(need)})")
            ops: dict[str, list[tuple[float, float]]] = {}
            for line, r in enumerate(reader, start=2):
                try:
                    ops.setdefault(r["layer"], []).append((float(r[key]), float(r["time_us"])))
                except (TypeError, ValueError):
                    raise ConfigError(f"{path}:{line}", f"expected numbers in {key}, time_us") from None
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from None
    if not ops:
        raise ConfigError(str(path), "no rows")
    return {op: _sorted_xy(pts) for op, pts in ops.items()}


def _sorted_xy(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Points sorted by x, a repeated x keeping its first value."""
    xs: list[float] = []
    ys: list[float] = []
    for x, y in sorted(points, key=lambda p: p[0]):
        if not xs or x != xs[-1]:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _sum_tables(tables: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float]]:
    """The sum of piecewise-linear tables, exactly, on the union of their points."""
    xs = sorted({x for t in tables for x in t[0]})
    return xs, [sum(_interp(*t, x) for t in tables) for x in xs]


def _moe_table(path: Path) -> dict[float, tuple[list[float], list[float]]]:
    """``{tokens: (activated experts, µs)}`` of an LLMServingSim ``moe.csv``."""
    if not path.exists():
        raise ConfigError(str(path), "no such file (the MoE model's fused-MoE profile)")
    by_tokens: dict[float, list[tuple[float, float]]] = {}
    for t, e, us in _read_csv(path, ("tokens", "activated_experts", "time_us")):
        by_tokens.setdefault(t, []).append((e, us))
    if not by_tokens:
        raise ConfigError(str(path), "no rows")
    return {t: _sorted_xy(pts) for t, pts in by_tokens.items()}
