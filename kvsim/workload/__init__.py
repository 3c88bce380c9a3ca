"""Workloads: immutable request records from a trace file or a seeded generator.

``build_requests(scenario)`` returns the run's ``RequestSpec`` list sorted by arrival time
(ties keep file/generation order), checked against the engine's ``max_model_len``.
"""

from __future__ import annotations

import numpy as np

from kvsim.config import Scenario
from kvsim.errors import ConfigError
from kvsim.request import RequestSpec
from kvsim.workload.jsonl import read_kvsim_jsonl
from kvsim.workload.synthetic import GENERATORS


def build_requests(sc: Scenario) -> list[RequestSpec]:
    """The scenario's requests in arrival order. Raises ConfigError on bad input."""
    w = sc.workload
    if w.kind == "trace":
        specs = read_kvsim_jsonl(w.path)
        where = str(w.path)
    else:
        rng = np.random.default_rng(sc.run.seed)
        specs = GENERATORS[w.generator](w, rng)
        where = "workload"
    if sc.run.max_requests is not None:
        specs = specs[: sc.run.max_requests]
    specs = sorted(specs, key=lambda s: s.arrival_s)  # stable: ties keep their order
    mml = sc.engine.max_model_len
    needs_trace = sc.speculative.enabled and sc.speculative.acceptance == "trace"
    for s in specs:
        if needs_trace and s.accepted is None:
            raise ConfigError(f"{where}: request {s.req_id}", "speculative.acceptance = 'trace' "
                              "needs an 'accepted' list on every request")
        if len(s.prompt) >= mml:
            raise ConfigError(f"{where}: request {s.req_id}",
                              f"prompt of {len(s.prompt)} tokens plus at least one output token "
                              f"exceeds max_model_len {mml} (vLLM rejects it)")
    return specs
