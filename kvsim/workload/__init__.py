"""Workloads: immutable request records from a trace file or a seeded generator.

``build_requests(scenario)`` returns the run's ``RequestSpec`` list sorted by arrival time
(ties keep file/generation order), checked against the engine's ``max_model_len``.

A trace is read by its format's reader, then cut to ``[window_start_s, window_end_s)`` of
trace time (shifted so the window starts at t = 0), sampled (``sample_fraction``, seeded),
and sped up (``speedup`` divides the arrival times); ``run.max_requests`` keeps the first N
of what is left. A synthetic workload with ``arrival = "trace"`` takes its arrival times
from a trace treated the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from itertools import islice
from pathlib import Path

import numpy as np

from kvsim.errors import ConfigError
from kvsim.request import RequestSpec
from kvsim.schema import Scenario, WorkloadCfg
from kvsim.workload.azure import read_azure
from kvsim.workload.jsonl import read_kvsim_jsonl
from kvsim.workload.mooncake import read_mooncake
from kvsim.workload.synthetic import GENERATORS, process_arrivals, trace_lengths

READERS = {"kvsim": read_kvsim_jsonl, "mooncake": read_mooncake, "azure": read_azure}

# Sub-streams of run.seed, apart from the generator's own default_rng(seed).
_SAMPLE_STREAM, _ACCEPT_STREAM = 1, 2


def read_trace(fmt: str, path: Path) -> list[RequestSpec]:
    """All requests of a trace file, in file order, arrivals in trace seconds."""
    return READERS[fmt](path)


def select(specs: list[RequestSpec], w: WorkloadCfg, seed: int, where: str) -> list[RequestSpec]:
    """Window, sample and speed up a trace's requests (see the module doc)."""
    lo, hi = w.window_start_s, w.window_end_s
    if lo > 0 or hi is not None:
        specs = [s for s in specs if s.arrival_s >= lo and (hi is None or s.arrival_s < hi)]
        if not specs:
            end = "the end" if hi is None else f"{hi:g} s"
            raise ConfigError(where, f"no request arrives in the window from {lo:g} s to {end}")
    if w.sample_fraction < 1:
        k = max(1, round(w.sample_fraction * len(specs)))
        rng = np.random.default_rng((seed, _SAMPLE_STREAM))
        keep = np.sort(rng.choice(len(specs), size=k, replace=False))
        specs = [specs[i] for i in keep]
    if lo > 0 or w.speedup != 1:
        specs = [replace(s, arrival_s=(s.arrival_s - lo) / w.speedup) for s in specs]
    return specs


def _read_trace(w: WorkloadCfg, seed: int) -> list[RequestSpec]:
    """The workload's trace file, its window and sample taken."""
    assert w.path is not None  # the scenario's check: a workload that reads a trace names it
    return select(read_trace(w.format, w.path), w, seed, str(w.path))


def _with_acceptances(specs: list[RequestSpec], w: WorkloadCfg, k: int, seed: int) -> list[RequestSpec]:
    """Give each request without one an ``accepted`` list (``acceptance_rate_mean``)."""
    mean, sd = w.acceptance_rate_mean, w.acceptance_rate_sd
    assert mean is not None  # called only when it is given
    rng = np.random.default_rng((seed, _ACCEPT_STREAM))
    if sd > 0 and 0 < mean < 1:
        nu = mean * (1 - mean) / (sd * sd) - 1  # beta(a, b) with this mean and sd
        rates = rng.beta(mean * nu, (1 - mean) * nu, size=len(specs))
    else:
        rates = np.full(len(specs), mean)
    out = []
    for s, p in zip(specs, rates):
        if s.accepted is not None:
            out.append(s)
            continue
        m = min(s.max_tokens, 512)  # cycled by the acceptance model
        if p >= 1:
            acc = np.full(m, k)
        else:
            # Leading successes before the first rejection, capped at k drafts.
            acc = np.minimum(rng.geometric(1 - p, size=m) - 1, k)
        out.append(replace(s, accepted=tuple(int(a) for a in acc)))
    return out


def _arrivals(sc: Scenario, rng: np.random.Generator):
    """``arrivals(n)`` of the scenario's arrival process (see ``synthetic``)."""
    w = sc.workload

    def arrivals(n: int) -> np.ndarray:
        if w.arrival != "trace":
            return process_arrivals(w, n, rng)
        times = sorted(s.arrival_s for s in _read_trace(w, sc.run.seed))
        if len(times) < n:
            raise ConfigError(f"{w.path}", f"the arrival trace has {len(times)} requests "
                              f"(after window and sampling); the generator needs {n}")
        return np.asarray(times[:n])

    return arrivals


def _trace_lengths(sc: Scenario, rng: np.random.Generator, arrivals) -> Iterator[RequestSpec]:
    w = sc.workload
    trace = _read_trace(w, sc.run.seed)
    lengths = np.array([(len(s.prompt), s.max_tokens) for s in trace], dtype=np.int64)
    return trace_lengths(w, rng, arrivals, lengths, sc.engine.max_model_len)


def iter_requests(sc: Scenario) -> Iterable[RequestSpec]:
    """The scenario's requests in arrival order, as ``build_requests`` gives them; made as
    they are consumed where the workload allows it (``trace_lengths`` without generated
    acceptance lists), so a run of millions of requests need not hold them all."""
    w = sc.workload
    if not (w.kind == "synthetic" and w.generator == "trace_lengths") or (
            w.acceptance_rate_mean is not None and sc.speculative.enabled) or (
            sc.speculative.enabled and sc.speculative.acceptance == "trace"):
        return build_requests(sc)
    rng = np.random.default_rng(sc.run.seed)
    specs = _trace_lengths(sc, rng, _arrivals(sc, rng))  # already in arrival order, checked
    return specs if sc.run.max_requests is None else islice(specs, sc.run.max_requests)


def build_requests(sc: Scenario) -> list[RequestSpec]:
    """The scenario's requests in arrival order. Raises ConfigError on bad input."""
    w = sc.workload
    seed = sc.run.seed
    if w.kind == "trace":
        where = str(w.path)
        specs = _read_trace(w, seed)
    else:
        rng = np.random.default_rng(seed)
        where = "workload"

        arrivals = _arrivals(sc, rng)
        if w.generator == "trace_lengths":
            specs = list(_trace_lengths(sc, rng, arrivals))
        else:
            specs = GENERATORS[w.generator](w, rng, arrivals)
    if sc.run.max_requests is not None:
        specs = specs[: sc.run.max_requests]
    if w.acceptance_rate_mean is not None and sc.speculative.enabled:
        specs = _with_acceptances(specs, w, sc.speculative.num_speculative_tokens, seed)
    specs = sorted(specs, key=lambda s: s.arrival_s)  # stable: ties keep their order
    mml = sc.engine.max_model_len
    needs_trace = sc.speculative.enabled and sc.speculative.acceptance == "trace"
    for s in specs:
        if needs_trace and s.accepted is None:
            raise ConfigError(f"{where}: request {s.req_id}", "speculative.acceptance = 'trace' "
                              "needs an 'accepted' list on every request (or set "
                              "workload.acceptance_rate_mean)")
        if len(s.prompt) >= mml:
            raise ConfigError(f"{where}: request {s.req_id}",
                              f"prompt of {len(s.prompt)} tokens plus at least one output token "
                              f"exceeds max_model_len {mml} (vLLM rejects it)")
    return specs
