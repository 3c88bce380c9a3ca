"""Speculative decoding: what each method reserves, and how many drafts get accepted.

``spec_setup`` turns ``[speculative]`` into the scheduler's and KV manager's view for the
chosen vLLM release (lookahead slots, draft input slots, the EAGLE prefix rule);
``Acceptance`` decides, per request and verify step, how many drafts are accepted:

* ``per_position``: drafts are accepted in order until the first rejection; position i is
  accepted with probability ``acceptance_rates[i]`` (the last rate repeats), from a random
  stream per request seeded by the run seed and the request's index, so a request's
  acceptances don't depend on what else runs;
* ``fixed``: ``num_accepted`` every verify step (fewer when fewer drafts were scheduled);
* ``trace``: the request's ``accepted`` list from the trace, cycled.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from kvsim.config import Scenario, SpecCfg, num_prefill_lookahead
from kvsim.errors import ConfigError
from kvsim.request import Request
from kvsim.sched import SpecParams
from kvsim.semantics import Semantics


@dataclass(frozen=True, slots=True)
class SpecSetup:
    params: SpecParams
    eagle_drop: bool  # drop the last matched prefix block
    hash_lookahead: int  # tokens after each block that its hash covers
    num_reprefillable: int  # trailing tokens never cached (multi-module MTP)


def spec_setup(sc: Scenario) -> SpecSetup:
    """The accounting consequences of ``[speculative]`` under the scenario's vLLM release."""
    e = sc.engine
    return derive_spec(sc.speculative, e.semantics, e.enable_prefix_caching, e.block_size,
                       sc.model.num_nextn_predict_layers)


def derive_spec(s: SpecCfg, sem: Semantics, enable_caching: bool, scheduler_block_size: int,
                num_nextn_predict_layers: int = 1) -> SpecSetup:
    """As ``spec_setup``, from the parts (also used to replay oracle scenarios)."""
    if not s.enabled:
        return SpecSetup(SpecParams(), False, 0, 0)
    k = s.num_speculative_tokens
    lookahead = k if (s.eagle_family or s.method == "draft_model") else 0
    if s.method == "draft_model":
        slots = k if s.parallel_drafting else 1
    else:
        slots = k - 1 if s.parallel_drafting else 0
    prefill_lookahead = num_prefill_lookahead(s.method, k, num_nextn_predict_layers, sem)
    hash_lookahead = 0
    if (s.eagle_family and sem.eagle_prefix_rule == "lookahead" and enable_caching
            and not s.disable_eagle_block_drop and not s.disable_lookahead_block_hashes):
        hash_lookahead = prefill_lookahead
    eagle_drop = s.eagle_family and not s.disable_eagle_block_drop and hash_lookahead == 0
    if enable_caching and s.eagle_family and scheduler_block_size < prefill_lookahead:
        raise ConfigError("speculative.num_speculative_tokens",
                          f"multi-module MTP with prefix caching needs block_size "
                          f"({scheduler_block_size}) >= num_speculative_tokens ({k}); vLLM refuses it")
    return SpecSetup(SpecParams(num_speculative_tokens=k, num_lookahead_tokens=lookahead,
                                draft_slots=slots, num_prefill_lookahead=prefill_lookahead),
                     eagle_drop, hash_lookahead, max(0, prefill_lookahead - 1))


class Acceptance:
    """Callable ``(request, num_drafts) -> accepted`` for one run."""

    def __init__(self, spec: SpecCfg, seed: int, record: bool = False):
        self.kind = spec.acceptance
        self.rates = spec.acceptance_rates
        self.fixed = spec.num_accepted
        self.seed = seed
        self._rngs: dict[int, random.Random] = {}
        # With ``record``: request index -> accepted count at each verify step (validation).
        self.log: dict[int, list[int]] | None = {} if record else None

    def __call__(self, req: Request, num_drafts: int) -> int:
        accepted = self._draw(req, num_drafts)
        if self.log is not None:
            self.log.setdefault(req.seq, []).append(accepted)
        return accepted

    def _draw(self, req: Request, num_drafts: int) -> int:
        if self.kind == "fixed":
            return min(self.fixed, num_drafts)
        if self.kind == "trace":
            seq = req.accepted_trace or (0,)
            return min(seq[req.num_verify_steps % len(seq)], num_drafts)
        rng = self._rngs.get(req.seq)
        if rng is None:
            rng = self._rngs[req.seq] = random.Random(f"{self.seed}:{req.seq}")
        rates, last = self.rates, len(self.rates) - 1
        accepted = 0
        while accepted < num_drafts and rng.random() < rates[min(accepted, last)]:
            accepted += 1
        return accepted

    def forget(self, req: Request) -> None:
        """Drop a finished request's random stream."""
        self._rngs.pop(req.seq, None)


class AcceptanceTally:
    """One engine's draws from an :class:`Acceptance` and its own counters of them (a
    cluster's replicas share one acceptance model, seeded per request)."""

    def __init__(self, accept: Acceptance):
        self._accept = accept
        self.forget = accept.forget
        # Drafts accepted -> verify steps that accepted that many (acceptance by position).
        self.outcomes: Counter[int] = Counter()

    def __call__(self, req: Request, num_drafts: int) -> int:
        accepted = self._accept(req, num_drafts)
        self.outcomes[accepted] += 1
        return accepted

    def accepted_per_pos(self, k: int) -> list[int]:
        """vLLM's ``num_accepted_tokens_per_pos``: verify steps whose draft i was accepted."""
        return [sum(n for a, n in self.outcomes.items() if a > i) for i in range(k)]
