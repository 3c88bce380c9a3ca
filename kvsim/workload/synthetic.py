"""Seeded synthetic workloads with shared structure.

Every generator takes the workload section, a numpy ``Generator`` seeded with ``run.seed``
and ``arrivals(n)``, which returns ``n`` sorted arrival times of the configured process
(``poisson``, ``gamma`` or ``trace``). Token ids come from disjoint ranges handed out in
generation order, so only the parts meant to be shared are shared:

``shared_prefix``  ``[ system prompt | history of user u | fresh input ]``; users uniform.
``multi_turn``     conversations of ``turns`` requests; turn t's prompt is
                   ``[ system | m1 | a1 | ... | a(t-1) | mt ]``: the whole history plus the new
                   message. The answers ``a`` are re-sent as prompt tokens; kvsim does not
                   model output content, so an answer misses the cache the first time it
                   comes back as history (as if re-tokenised differently) and hits after.
``rag``            ``[ system | d1 ... dk | question ]``: k distinct documents from a pool,
                   drawn by Zipf popularity (weight ``rank ** -zipf_s``), in draw order.
``agent``          sessions of ``turns`` steps: ``[ system | context | o1 | a1 | ... | ot ]``, a
                   long per-session context that grows by a tool observation (exponential,
                   mean ``input_tokens``) and the previous action at every step; outputs short.
``trace_lengths``  ``[ fresh prompt ]``, (prompt, output) lengths drawn from a trace's
                   requests (its empirical distribution), arrivals from the arrival process.
``random``         ``[ shared random prefix | fresh prompt ]``, vLLM's benchmark ``random``
                   dataset: lengths uniform around ``random_input_len`` / ``random_output_len``.

Session ids (for a cluster's ``session_affinity`` router): the user (``shared_prefix``), the
conversation (``multi_turn``), the session (``agent``); ``rag`` requests have none.

The arrival process gives the requests (``shared_prefix``, ``rag``) or the first turn of each
conversation / session (``multi_turn``, ``agent``); a later turn arrives an exponential
think time (mean ``think_time_s``) after the previous turn's arrival (open loop: it does
not wait for the answer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

from kvsim.errors import ConfigError
from kvsim.request import RequestSpec, SegmentTokens
from kvsim.schema import WorkloadCfg

Arrivals = Callable[[int], np.ndarray]


def process_arrivals(w: WorkloadCfg, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times of a Poisson or gamma renewal process at ``request_rate``."""
    if np.isinf(w.request_rate):
        return np.zeros(n)
    if w.arrival == "gamma":
        # Gamma inter-arrival times with mean 1 / rate and CV arrival_cv: shape 1 / cv^2.
        shape = 1.0 / (w.arrival_cv * w.arrival_cv)
        return np.cumsum(rng.gamma(shape, 1.0 / (w.request_rate * shape), size=n))
    return np.cumsum(rng.exponential(1.0 / w.request_rate, size=n))


class _Ids:
    """Hands out disjoint token-id ranges, in order, from 1 up."""

    def __init__(self):
        self.next = 1

    def take(self, n: int) -> tuple[int, int]:
        seg = (self.next, n)
        self.next += n
        return seg


def _think(w: WorkloadCfg, rng: np.random.Generator) -> float:
    return float(rng.exponential(w.think_time_s)) if w.think_time_s > 0 else 0.0


def shared_prefix(w: WorkloadCfg, rng: np.random.Generator, arrivals: Arrivals) -> list[RequestSpec]:
    n = w.num_requests
    times = arrivals(n)
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
        specs.append(RequestSpec(req_id=f"u{u}-r{i}", arrival_s=float(times[i]),
                                 prompt=SegmentTokens(segs), max_tokens=w.output_tokens,
                                 session_id=f"u{u}"))
    return specs


def multi_turn(w: WorkloadCfg, rng: np.random.Generator, arrivals: Arrivals) -> list[RequestSpec]:
    n, turns = w.num_requests, w.turns
    starts = arrivals(-(-n // turns))
    ids = _Ids()
    system = [ids.take(w.system_prompt_tokens)] if w.system_prompt_tokens else []
    specs = []
    for c, start in enumerate(starts):
        t_arr = float(start)
        history: list[tuple[int, int]] = []
        for t in range(min(turns, n - c * turns)):
            history.append(ids.take(w.input_tokens))
            specs.append(RequestSpec(req_id=f"c{c}-t{t}", arrival_s=t_arr,
                                     prompt=SegmentTokens(system + history),
                                     max_tokens=w.output_tokens, session_id=f"c{c}"))
            history.append(ids.take(w.output_tokens))  # the answer, re-sent next turn
            t_arr += _think(w, rng)
    return specs


def agent(w: WorkloadCfg, rng: np.random.Generator, arrivals: Arrivals) -> list[RequestSpec]:
    n, steps = w.num_requests, w.turns
    starts = arrivals(-(-n // steps))
    ids = _Ids()
    system = [ids.take(w.system_prompt_tokens)] if w.system_prompt_tokens else []
    specs = []
    for s, start in enumerate(starts):
        t_arr = float(start)
        history = [ids.take(w.context_tokens)] if w.context_tokens else []
        for k in range(min(steps, n - s * steps)):
            obs = max(1, round(float(rng.exponential(w.input_tokens))))
            history.append(ids.take(obs))
            specs.append(RequestSpec(req_id=f"s{s}-k{k}", arrival_s=t_arr,
                                     prompt=SegmentTokens(system + history),
                                     max_tokens=w.output_tokens, session_id=f"s{s}"))
            history.append(ids.take(w.output_tokens))  # the action, part of the next context
            t_arr += _think(w, rng)
    return specs


def rag(w: WorkloadCfg, rng: np.random.Generator, arrivals: Arrivals) -> list[RequestSpec]:
    n, k, dt = w.num_requests, w.documents_per_request, w.document_tokens
    times = arrivals(n)
    ids = _Ids()
    system = [ids.take(w.system_prompt_tokens)] if w.system_prompt_tokens else []
    doc_base, _ = ids.take(w.num_documents * dt)
    weights = np.arange(1, w.num_documents + 1, dtype=float) ** -w.zipf_s
    popularity = weights / weights.sum()
    specs = []
    for i in range(n):
        docs = rng.choice(w.num_documents, size=k, replace=False, p=popularity)
        segs = system + [(doc_base + int(d) * dt, dt) for d in docs] + [ids.take(w.input_tokens)]
        specs.append(RequestSpec(req_id=f"q{i}", arrival_s=float(times[i]),
                                 prompt=SegmentTokens(segs), max_tokens=w.output_tokens))
    return specs


def trace_lengths(w: WorkloadCfg, rng: np.random.Generator, arrivals: Arrivals,
                  lengths: np.ndarray, max_model_len: int) -> Iterator[RequestSpec]:
    """Requests whose (prompt, output) lengths are drawn, with replacement, from a trace's
    requests (``lengths``: one row each); every prompt is its own run of token ids, shared
    with no other request (as in ``azure``). Made as they are consumed, so a million requests
    cost a few arrays; the draws are checked against ``max_model_len`` up front."""
    n = w.num_requests
    times = arrivals(n)
    rows = lengths[rng.integers(0, len(lengths), size=n)]
    too_long = np.flatnonzero(rows[:, 0] >= max_model_len)
    if too_long.size:
        i = int(too_long[0])
        raise ConfigError(f"workload: request {i}", f"prompt of {rows[i, 0]} tokens (drawn from "
                          f"{w.path}) plus at least one output token exceeds max_model_len "
                          f"{max_model_len} (vLLM rejects it)")
    starts = 1 + np.concatenate(([0], np.cumsum(rows[:-1, 0])))

    def specs() -> Iterator[RequestSpec]:
        for i in range(n):
            yield RequestSpec(req_id=f"t{i}", arrival_s=float(times[i]),
                              prompt=SegmentTokens([(int(starts[i]), int(rows[i, 0]))]),
                              max_tokens=int(rows[i, 1]))

    return specs()


def random_lengths(length: int, ratio: float, rule: str, size: int,
                   rng: np.random.Generator) -> np.ndarray:
    """``size`` lengths drawn as a benchmark client's random dataset draws them around
    ``length`` with range ratio ``ratio``: uniform whole numbers on [floor(L(1 - r)),
    ceil(L(1 + r))] (``centered``, vllm bench serve) or [int(r L), L] (``below``,
    benchmark_serving.py), at least 1."""
    if rule == "centered":
        low, high = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    else:
        low, high = int(length * ratio), length
    return rng.integers(max(low, 1), max(high, 1) + 1, size=size)


def random_dataset(w: WorkloadCfg, rng: np.random.Generator, arrivals: Arrivals) -> list[RequestSpec]:
    """vLLM's ``random`` benchmark dataset: ``[ prefix | fresh tokens ]``, the prefix one run
    shared by every request (``random_prefix_len``), the rest drawn per request and shared with
    none (vLLM's prompts start at a random offset in the vocabulary); output lengths drawn the
    same way and generated in full (``--ignore-eos``)."""
    n = w.num_requests
    times = arrivals(n)
    inputs = random_lengths(w.random_input_len, w.random_range_ratio, w.random_range_rule, n, rng)
    outputs = random_lengths(w.random_output_len, w.random_range_ratio, w.random_range_rule, n,
                             rng)
    ids = _Ids()
    prefix = [ids.take(w.random_prefix_len)] if w.random_prefix_len else []
    return [RequestSpec(req_id=f"r{i}", arrival_s=float(times[i]),
                        prompt=SegmentTokens(prefix + [ids.take(int(inputs[i]))]),
                        max_tokens=int(outputs[i])) for i in range(n)]


GENERATORS = {"shared_prefix": shared_prefix, "multi_turn": multi_turn, "rag": rag, "agent": agent,
              "random": random_dataset}
