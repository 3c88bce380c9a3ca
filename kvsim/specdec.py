"""Speculative decoding: what each method reserves, and how many drafts get accepted.

``derive_spec`` turns a ``Drafting`` (the method and its settings, the accounting's own record
of ``[speculative]``) into the scheduler's and KV manager's view for the chosen vLLM release
(lookahead slots, draft input slots, the EAGLE prefix rule); ``Acceptance`` decides, per
request and verify step, how many drafts are accepted:

* ``per_position``: drafts are accepted in order until the first rejection; position i is
  accepted with probability ``acceptance_rates[i]`` (one rate: every position), from a random
  stream per request seeded by the run seed and the request's index, so a request's
  acceptances don't depend on what else runs;
* ``fixed``: ``num_accepted`` every verify step (fewer when fewer drafts were scheduled);
* ``trace``: the request's ``accepted`` list from the trace, cycled.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Literal, get_args

from kvsim.errors import ConfigError
from kvsim.request import Request
from kvsim.sched import SpecParams
from kvsim.semantics import Semantics

# vLLM's --speculative-config methods kvsim models ("none": off).
SpecMethod = Literal["none", "ngram", "eagle", "eagle3", "mtp", "draft_model"]
SPEC_METHODS: tuple[SpecMethod, ...] = get_args(SpecMethod)
EAGLE_METHODS: tuple[SpecMethod, ...] = ("eagle", "eagle3", "mtp")
AcceptanceKind = Literal["per_position", "fixed", "trace"]


def num_prefill_lookahead(method: SpecMethod, k: int, num_nextn_predict_layers: int,
                          sem: Semantics) -> int:
    """vLLM 0.32+'s num_prefill_lookahead_tokens: how far an EAGLE-family drafter reads past
    a prefill chunk (1; k for multi-module MTP, each module one token further)."""
    if method not in EAGLE_METHODS or not sem.has_prefill_lookahead:
        return 0
    return k if method == "mtp" and min(num_nextn_predict_layers, k) > 1 else 1


@dataclass(frozen=True, slots=True)
class Drafting:
    """What the accounting needs of speculative decoding: the method, k, vLLM's opt-outs and
    the MTP modules the checkpoint ships."""

    method: SpecMethod
    num_speculative_tokens: int
    disable_eagle_block_drop: bool
    disable_lookahead_block_hashes: bool
    parallel_drafting: bool
    num_nextn_predict_layers: int

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def eagle_family(self) -> bool:
        return self.method in EAGLE_METHODS


@dataclass(frozen=True, slots=True)
class SpecSetup:
    params: SpecParams
    eagle_drop: bool  # drop the last matched prefix block
    hash_lookahead: int  # tokens after each block that its hash covers
    num_reprefillable: int  # trailing tokens never cached (multi-module MTP)


def derive_spec(s: Drafting, sem: Semantics, enable_caching: bool,
                scheduler_block_size: int, kv_transfer: bool = False) -> SpecSetup:
    """The accounting consequences of speculative decoding ``s`` under release ``sem``
    (``kv_transfer``: a KV connector is configured, which turns 0.33's lookahead block hashes
    off: ``VllmConfig.num_hash_lookahead_tokens``)."""
    if not s.enabled:
        return SpecSetup(SpecParams(), False, 0, 0)
    k = s.num_speculative_tokens
    lookahead = k if (s.eagle_family or s.method == "draft_model") else 0
    if s.method == "draft_model":
        slots = k if s.parallel_drafting else 1
    else:
        slots = k - 1 if s.parallel_drafting else 0
    prefill_lookahead = num_prefill_lookahead(s.method, k, s.num_nextn_predict_layers, sem)
    hash_lookahead = 0
    if (s.eagle_family and sem.eagle_prefix_rule == "lookahead" and enable_caching
            and not s.disable_eagle_block_drop and not s.disable_lookahead_block_hashes
            and not kv_transfer):
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
    """Callable ``(request, num_drafts) -> accepted`` for one run: the ``kind`` of model with
    its ``rates`` (per_position) or ``num_accepted`` (fixed)."""

    def __init__(self, kind: AcceptanceKind, rates: tuple[float, ...], num_accepted: int,
                 seed: int, record: bool = False):
        self.kind = kind
        self.rates = rates
        self.fixed = num_accepted
        self.seed = seed
        self._streams: dict[int, Iterator[float]] = {}  # per_position: each request's uniforms
        # per_position: a request's verify steps drawn ahead by ``peek``, not yet used: the
        # drafts they were drawn for, their accepted counts, and the uniforms those used.
        self._ahead: dict[int, tuple[int, list[int], list[float]]] = {}
        # With ``record``: request index -> accepted count at each verify step (validation).
        self.log: dict[int, list[int]] | None = {} if record else None

    def __call__(self, req: Request, num_drafts: int) -> int:
        if self.log is None:
            if self.kind == "fixed":
                return min(self.fixed, num_drafts)
            if self.kind == "per_position" and req.seq not in self._ahead:
                return self._count(self._stream(req), num_drafts)
        return self.take(req, num_drafts, 1)[0]

    def peek(self, req: Request, num_drafts: int, count: int) -> list[int]:
        """What the request's next ``count`` verify steps of ``num_drafts`` drafts each
        accept, without using them up (its stream is its own: nothing else draws from it)."""
        if self.kind == "fixed":
            return [min(self.fixed, num_drafts)] * count
        if self.kind == "trace":
            seq = req.accepted_trace or (0,)
            done = req.num_verify_steps
            return [min(seq[(done + i) % len(seq)], num_drafts) for i in range(count)]
        ahead = self._ahead.get(req.seq)
        if ahead is None or ahead[0] != num_drafts:  # (drawn for other drafts: counted again)
            uniforms = ahead[2] if ahead is not None else []
            replay, kept = iter(uniforms), len(uniforms)
            counts: list[int] = []
            used = 0
            while used < kept:  # the uniforms drawn already, then fresh ones
                counts.append(self._count(chain(replay, self._recording(req, uniforms)),
                                          num_drafts))
                used += counts[-1] + (counts[-1] < num_drafts)
            ahead = self._ahead[req.seq] = (num_drafts, counts, uniforms)
        counts = ahead[1]
        if len(counts) < count:
            fresh = self._recording(req, ahead[2])
            counts.extend(self._count(fresh, num_drafts) for _ in range(count - len(counts)))
        return counts[:count]

    def take(self, req: Request, num_drafts: int, count: int) -> list[int]:
        """``peek``, used up: the request's next ``count`` verify steps (their ``num_verify_steps``
        counted by the caller after)."""
        out = self.peek(req, num_drafts, count)
        if self.kind == "per_position":
            _, counts, uniforms = self._ahead[req.seq]
            del counts[:count]
            del uniforms[:sum(out) + sum(a < num_drafts for a in out)]  # (one per accepted
            if not counts:                                              # draft, one rejection)
                del self._ahead[req.seq]
        if self.log is not None:
            self.log.setdefault(req.seq, []).extend(out)
        return out

    def _stream(self, req: Request) -> Iterator[float]:
        """The request's uniforms (its own seeded stream)."""
        stream = self._streams.get(req.seq)
        if stream is None:
            rng = random.Random(f"{self.seed}:{req.seq}")
            stream = self._streams[req.seq] = iter(rng.random, None)
        return stream

    def _recording(self, req: Request, into: list[float]) -> Iterator[float]:
        """The request's stream, each uniform also kept in ``into``."""
        for u in self._stream(req):
            into.append(u)
            yield u

    def _count(self, uniforms: Iterator[float], num_drafts: int) -> int:
        """per_position: drafts accepted in order until the first rejection, position i
        with probability ``rates[i]``: one uniform per accepted draft and one rejecting."""
        rates, last = self.rates, len(self.rates) - 1
        accepted = 0
        while accepted < num_drafts and next(uniforms) < rates[min(accepted, last)]:
            accepted += 1
        return accepted

    def forget(self, req: Request) -> None:
        """Drop a finished request's random stream."""
        self._streams.pop(req.seq, None)
        self._ahead.pop(req.seq, None)


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

    def peek(self, req: Request, num_drafts: int, count: int) -> list[int]:
        return self._accept.peek(req, num_drafts, count)

    def take(self, req: Request, num_drafts: int, count: int) -> list[int]:
        out = self._accept.take(req, num_drafts, count)
        self.outcomes.update(out)
        return out

    def accepted_per_pos(self, k: int) -> list[int]:
        """vLLM's ``num_accepted_tokens_per_pos``: verify steps whose draft i was accepted."""
        return [sum(n for a, n in self.outcomes.items() if a > i) for i in range(k)]
