"""Seeded synthetic workloads with shared-prefix structure.

``shared_prefix``: every prompt is

    [ system prompt | history of user u | fresh input ]
      shared by all   shared by u's requests   unique

users are drawn uniformly, arrivals are Poisson at ``request_rate`` (all at t = 0 when it is
``inf``). Token ids come from disjoint ranges, so only the intended parts are shared.
"""

from __future__ import annotations

import numpy as np

from kvsim.config import WorkloadCfg
from kvsim.request import RequestSpec, SegmentTokens


def shared_prefix(w: WorkloadCfg, rng: np.random.Generator) -> list[RequestSpec]:
    n = w.num_requests
    if np.isinf(w.request_rate):
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / w.request_rate, size=n))
    users = rng.integers(0, w.num_users, size=n)
    system = (1, w.system_prompt_tokens)
    history_base = 1 + w.system_prompt_tokens
    fresh_base = history_base + w.num_users * w.user_history_tokens
    specs = []
    for i in range(n):
        u = int(users[i])
        segs = []
        if w.system_prompt_tokens:
            segs.append(system)
        if w.user_history_tokens:
            segs.append((history_base + u * w.user_history_tokens, w.user_history_tokens))
        segs.append((fresh_base + i * w.input_tokens, w.input_tokens))
        specs.append(RequestSpec(req_id=f"u{u}-r{i}", arrival_s=float(arrivals[i]),
                                 prompt=SegmentTokens(segs), max_tokens=w.output_tokens))
    return specs


GENERATORS = {"shared_prefix": shared_prefix}
