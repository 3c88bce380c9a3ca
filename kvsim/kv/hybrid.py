"""Hybrid KV-cache layouts: several KV groups (full attention, sliding window, Mamba) on one pool.

Mirrors vLLM's ``HybridKVCacheCoordinator`` and its per-type managers:

* hashes are computed at ``H = gcd(block sizes)``; a group with ``b_g = s·H`` keys its block
  ``j`` by the ``s`` fine hashes it spans, and every map key carries the group id;
* hits are aligned to ``U = lcm(block sizes)`` (the scheduler block size) and found by a
  fixed-point intersection: full attention first (looked up once: it is downward-closed), then
  each other group accepts or shortens the candidate, until nothing shortens it (one pass for
  a "simple hybrid": one full-attention group plus one other);
* a sliding-window group needs only the ``cdiv(w − 1, b)`` blocks before the hit end, so it
  scans right to left and pads the skipped prefix with the null block; blocks that slide out
  of the window are freed mid-request;
* EAGLE groups (drop mode) look one block further, then drop it; writes are rounded down to
  ``U`` (plus, where the release caches it, the one block past ``U`` an EAGLE group needs);
  a sliding-window group only publishes the blocks a future aligned hit can use;
* checkpoint retention (vLLM 0.32+'s ``prefix_cache_retention_interval``): sliding-window and
  Mamba groups publish the tail a hit needs only at a prompt's replay boundaries and at a
  shared-prefix junction a lookup found (``0``, the default), also once per interval (a
  positive multiple of ``U``), or at every ``U`` boundary (``None``: dense, the only rule
  before 0.32);
* a Mamba group keeps one state block per request (plus ``num_speculative_blocks``) and, in
  "align" mode (prefix caching on), checkpoints the state at block-aligned chunk ends: a hit
  is the last cached checkpoint, null-padded before it; older states are freed as the request
  advances, and a checkpoint published in this step is not hittable until the next one;
  Mamba2/GDN layers (``prefill_checkpoint_alignment``, 0.32+) write the checkpoint from inside
  the chunk that reaches the prefill end, into a block reserved for it, so that chunk is not
  cut there.

Every group draws on the same ``BlockPool``; each group keeps its own block tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import gcd, lcm
from typing import Literal

from kvsim.errors import EngineDeadError
from kvsim.kv.hashing import BlockHasher
from kvsim.kv.pool import Block, BlockPool
from kvsim.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def replay_boundaries(num_prompt_tokens: int, block_size: int, eagle_drop: bool) -> tuple[int, ...]:
    """vLLM's replay_boundaries (0.32+ kv_cache_coordinator.py): where a later request
    replaying a prompt can resume. A resend of the whole prompt is capped at ``L - 1``; under
    the EAGLE drop a hit ends a block earlier, at the resend's or at a longer sibling's last
    aligned block."""
    if not eagle_drop:
        return (num_prompt_tokens - 1,)
    resend = (num_prompt_tokens - 1) // block_size * block_size
    extension = num_prompt_tokens // block_size * block_size
    return tuple(sorted({max(resend - block_size, 0), max(extension - block_size, 0)}))


def mamba_checkpoint_position(num_tokens: int, block_size: int, eagle_drop: bool,
                              hash_lookahead: int) -> int:
    """vLLM's get_mamba_prefill_checkpoint_position (0.32+): the last block boundary whose state
    a later request can reuse. Leave tokens for the logits and the boundary's hash; under the
    EAGLE drop, one block earlier (Mamba checkpoints follow the attention replay boundary)."""
    if eagle_drop:
        return max(num_tokens // block_size * block_size - block_size, 0)
    return max((num_tokens - max(1, hash_lookahead)) // block_size * block_size, 0)


def mamba_checkpoint_exportable(query_start: int, query_end: int, checkpoint: int,
                                hash_block_size: int, block_size: int, alignment: int | None) -> bool:
    """vLLM's is_mamba_prefill_checkpoint_valid (0.32+): whether a layer that exports prefill
    checkpoints from inside a chunk (Mamba2: any offset; GDN with FlashInfer: on the block
    grid) can write the state at ``checkpoint`` in the chunk ``[query_start, query_end)``."""
    if alignment is None:
        return False
    return (query_start % hash_block_size == 0
            and cdiv(query_end, block_size) - 2 > (query_start - 1) // block_size
            and query_start + hash_block_size <= checkpoint
            and query_start < checkpoint < query_end
            and (checkpoint - query_start) % alignment == 0)


GroupKind = Literal["full_attention", "sliding_window", "mamba"]
SwaEagleScan = Literal["assert", "pre_pop", "post_pop"]
MambaSplit = Literal["last_block", "last_block_junction", "last_block_stops", "prefill_end_stops",
                     "checkpoint"]
PartialTailLimit = Literal["prompt", "resend"]
SwaAdmissionCap = Literal["never", "gate", "always"]


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group: ``kind`` is ``full_attention``, ``sliding_window`` or ``mamba``."""

    kind: GroupKind
    block_size: int
    sliding_window: int = 0
    eagle: bool = False  # holds the drafter's layer
    num_layers: int | None = None  # memory estimate only
    # Mamba only: the token alignment at which the layers export a prefill checkpoint from
    # inside a chunk (vLLM 0.32+'s MambaSpec.prefill_checkpoint_alignment with one
    # num_prefill_checkpoint_blocks): 1 for Mamba2 layers, the block size for GDN with the
    # FlashInfer prefill kernel; None (Mamba1, GDN on FLA) splits the prefill instead.
    prefill_checkpoint_alignment: int | None = None

    def max_blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int,
                               num_speculative_blocks: int = 0, mamba_align: bool = False,
                               extra_retained_tokens: int = 0) -> int:
        """Blocks vLLM's start-up check reserves for one ``max_model_len`` request (the
        specs' max_memory_usage_bytes): a window's recycled blocks plus one for a window
        not starting on a block; a Mamba state (two in "align" mode: the previous and the
        current one) plus the speculative state blocks."""
        if self.kind == "sliding_window":
            tokens = min(self.sliding_window - 1 + extra_retained_tokens + max_in_flight_tokens,
                         max_model_len)
            return cdiv(tokens, self.block_size) + 1
        if self.kind == "mamba":
            if not mamba_align:
                return 1 + num_speculative_blocks
            return 2 + num_speculative_blocks + (self.prefill_checkpoint_alignment is not None)
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True, slots=True)
class HybridRules:
    """Release-specific rules of the hybrid coordinator.

    ``lookup``: ``"spiral"`` (0.19: every group drops a block on every pass, #32802),
    ``"max_hit"`` (0.22: each EAGLE group drops once per candidate, looking one block ahead
    but not past ``num_tokens - 1``), ``"hashes"`` (0.32+: the look-ahead is bounded by the
    hashed tokens instead).
    ``writes``: ``"all"`` (0.19: every group caches every full block), ``"u_rounded"`` (0.22:
    every group caches only up to the U boundary and the sliding-window mask keeps no EAGLE
    block: the 32K -> 16K bug), ``"eagle_extra"`` (0.32+: an EAGLE group also caches the block
    past U, and the mask keeps it, #44082).
    """

    lookup: str = "hashes"
    writes: str = "eagle_extra"
    # A sliding-window group's block count capped at max_admission_blocks_per_request
    # (SlidingWindowSpec: cdiv(min(window - 1 + in-flight tokens, max_model_len), b) + 1):
    # ``"never"`` (0.19), ``"gate"`` (0.20.2+: only in the full-sequence admission gate,
    # ``apply_admission_cap``) or ``"always"`` (0.20.0/0.20.1: in every count, the per-step
    # allocation check too, while the allocation takes the uncapped count; when the pool
    # holds fewer blocks than that, BlockPool.get_new_blocks raises and the engine dies:
    # 0.20.0 single_type_kv_cache_manager.py:116-128, :238-260, block_pool.py:334).
    swa_admission_cap: SwaAdmissionCap = "gate"
    trim_all_full_groups: bool = True  # 0.32+ trims every full-attention group to the hit
    per_group_eagle_flags: bool = True  # 0.19 has none: with EAGLE on, every group drops
    # EAGLE with a sliding-window block ``b`` smaller than U (SlidingWindowManager.
    # find_longest_cache_hit): ``"assert"`` (0.19.0: an assertion kills the engine at the first
    # hit the window's scan finds, 0.19.0 single_type_kv_cache_manager.py:567-570),
    # ``"pre_pop"`` (0.19.1: a run may end only where its length before the EAGLE drop is
    # U-aligned, ``(i + 1) * b % U``; drop, then re-align), ``"post_pop"`` (0.20+: where the
    # length after the drop is, ``i * b % U``; 0.20.0 single_type_kv_cache_manager.py:559-562).
    swa_eagle_scan: SwaEagleScan = "post_pop"
    # 0.26+ publish the prompt tail inside a coarse full-attention block (partial entry), at
    # the last hash boundary of ``"prompt"`` (0.26: num_prompt_tokens, 0.26
    # single_type_kv_cache_manager.py:765-792) or of what a resend can hit, ``"resend"`` (0.32+:
    # num_prompt_tokens - 1, the whole prompt in an EAGLE group; 0.32 :860-868).
    partial_tail_hashes: bool = True
    partial_tail_limit: PartialTailLimit = "resend"
    # 0.23 only: the blocks remove_skipped_blocks frees (a window's, a Mamba group's old
    # states) and a sliding-window group's whole table when its request is freed go to the
    # free queue's front where they carry no hash (0.23.0 single_type_kv_cache_manager.py
    # :497-501, 751-765: ``free_blocks(..., prepend=True)``). From 0.24 the pool's own rule
    # decides for every free (``Semantics.free_unhashed_to_front``).
    skipped_unhashed_to_front: bool = False
    # Mamba "align" mode. ``mamba_split``: how the scheduler cuts prefill chunks so that
    # states land on block boundaries: ``"last_block"`` (0.19-0.23: align chunks, force one to
    # end at the prompt's last full block, a block earlier under EAGLE),
    # ``"last_block_junction"`` (0.24/0.25: also end an admitted request's first chunk at the
    # shared-prefix junction its lookup found, block-floored from the hit: "Marconi",
    # scheduler.py:377-385, kv_cache_coordinator.py:729), ``"last_block_stops"`` (0.26: the
    # last-block position and floor, then the earliest mandatory stop inside the chunk: the
    # block grid after a mid-block start, the last block, the junction in any prefill chunk;
    # 0.26 scheduler.py:355-423), ``"prefill_end_stops"`` (0.27: the same stops, the end
    # floored whenever it is before the prefill end, by less than a block when a block is
    # more than a chunk; 0.27 scheduler.py:362-440) or ``"checkpoint"`` (0.32+: the same with
    # the checkpoint position, get_mamba_prefill_checkpoint_position, instead of the last
    # block, and checkpoints exported from inside a chunk). ``mamba_retire``: 0.30+ free old states past
    # null gaps and remember how far they got (0.30 single_type_kv_cache_manager.py
    # :1625-1644); before, stop at the first null block. ``mamba_min_cap``: 0.31+ take at
    # most the 1 (+ speculative) state blocks a step needs, min with what is missing (0.31
    # :1805-1811); before, always count that cap. (The count stepped back and the no-op
    # allocation are the two fields after ``mamba_tail_rekey``.)
    # ``mamba_eagle_margin``: an EAGLE-flagged Mamba group is looked up one block past the
    # candidate (0.19/0.22; its finder never drops, so the hit can grow back).
    # On later passes the (downward-closed) full-attention group caps the candidate at its
    # own hit (0.32+); 0.19/0.22 only round the candidate down to its block size, so a group
    # looked up past the candidate (an EAGLE Mamba group) can raise the hit above it.
    cap_at_full_attention_hit: bool = True
    mamba_split: MambaSplit = "checkpoint"
    # 0.32+ (re-)register the prompt's checkpoint state under its prefix hash each time the
    # request caches up to exactly that position, which also defers same-step hits on it:
    # ``"always"`` (0.32), ``"unless_keyed"`` (0.33: not when the block already carries that
    # entry), ``"never"`` (0.19/0.22 have no such entry).
    mamba_tail_rekey: str = "unless_keyed"
    mamba_retire: bool = True
    mamba_min_cap: bool = True
    # 0.19-0.25 MambaManager.remove_skipped_blocks first steps the computed count back by
    # num_speculative_blocks tokens (async drafts may be rejected; 0.25
    # single_type_kv_cache_manager.py:1156); 0.26+ pass the processed tokens as they are.
    mamba_skip_back_spec_blocks: bool = False
    # 0.28+: an align-mode allocation that needs no new block marks the request allocated all
    # the same (0.28 single_type_kv_cache_manager.py:1574-1578), so later steps move its
    # speculative blocks instead of taking new ones.
    mamba_noop_marks_allocated: bool = True
    mamba_eagle_margin: bool = False
    # Under sparse retention an EAGLE (drop) group also keeps the tail ending one of its
    # blocks before a shared-prefix junction (0.33: a sibling diverging right after the
    # junction has no peek block there); 0.32 keeps only the junction's.
    junction_eagle_tail: bool = True
    # Under sparse retention an EAGLE (drop) layout keeps the tails of both prompt positions
    # a replay can resume at (0.30+, kv_cache_coordinator.py replay_boundaries); 0.29 only
    # that of num_prompt_tokens - 1 (0.29 single_type_kv_cache_manager.py:459).
    replay_boundaries_eagle: bool = True
    # Sparse retention applies to Mamba states too (0.24+, MambaManager.reachable_block_mask;
    # 0.23 sparsifies sliding windows only and keeps every Mamba state, 0.23
    # kv_cache_coordinator.py:38-50).
    mamba_retention: bool = True
    # Under sparse retention the shared-prefix junction a lookup found is a reachable boundary
    # too (0.26+, single_type_kv_cache_manager.py cache_blocks: reachable_boundaries); 0.23-0.25
    # keep only the replay boundary's tail (0.23 :739-746).
    retention_junction: bool = True


class _Group:
    """Per-group state: block tables and how many of each table's blocks are published."""

    def __init__(self, gid: int, spec: GroupSpec):
        self.gid = gid
        self.spec = spec
        self.block_size = spec.block_size
        self.tables: dict[str, list[Block]] = {}
        self.num_cached: dict[str, int] = {}
        self.use_eagle = False  # set by the coordinator: drop-mode EAGLE group
        # Sliding window: tokens kept below the window for multi-module MTP's re-prefill
        # (vLLM 0.32+'s SlidingWindowSpec.extra_retained_tokens; set by the manager).
        self.extra_retained = 0
        # Mamba "align" bookkeeping (vLLM's MambaManager): requests that got their first
        # state blocks, the state block of the previous step, how far old states were retired,
        # and the keys published in this step (not hittable until the next one, #29387).
        self.allocated: set[str] = set()
        self.last_state_idx: dict[str, int] = {}
        self.num_retired: dict[str, int] = {}
        self.cached_this_step: set[int] = set()
        # The checkpoint (position, block index) this step's chunk exports from inside.
        self.checkpoints: dict[str, tuple[int, int]] = {}

    def num_skipped_tokens(self, num_computed: int) -> int:
        if self.spec.kind == "sliding_window":  # the window, and the re-prefillable tail below it
            return max(0, num_computed - self.spec.sliding_window + 1 - self.extra_retained)
        if self.spec.kind == "mamba":
            return num_computed - 1  # only the state after the last computed token is needed
        return 0

    def contiguous_blocks_for_hit(self, use_eagle: bool) -> int:
        return cdiv(self.spec.sliding_window - 1, self.block_size) + (1 if use_eagle else 0)


class HybridKVCacheManager:
    """The KV manager interface of ``KVCacheManager`` for several groups."""

    def __init__(self, pool: BlockPool, groups: list[GroupSpec], max_model_len: int,
                 enable_caching: bool, eagle_family: bool = False, eagle_drop: bool = False,
                 hash_lookahead: int = 0, num_reprefillable: int = 0,
                 max_in_flight_tokens: int = 0, rules: HybridRules = HybridRules(),
                 num_speculative_blocks: int = 0, retention_interval: int | None = None):
        self.pool = pool
        self.groups = [_Group(i, g) for i, g in enumerate(groups)]
        sizes = [g.block_size for g in groups]
        self.hash_block_size = gcd(*sizes)
        self.block_size = lcm(*sizes)  # U: the scheduler block size and hit alignment
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.num_reprefillable = num_reprefillable
        for g in self.groups:
            if g.spec.kind == "sliding_window":
                g.extra_retained = num_reprefillable
        self.max_in_flight_tokens = max_in_flight_tokens
        self.rules = rules
        # prefix_cache_retention_interval: None = dense, 0 = semantic checkpoints only, > 0 =
        # also one per that many tokens (a multiple of U; checked by the configuration).
        self.retention_interval = retention_interval
        self.hasher = BlockHasher(self.hash_block_size, hash_lookahead)
        self._coarse: dict[tuple, int] = {}
        self.eagle_drop = eagle_drop
        self.hash_lookahead = hash_lookahead
        self.mamba_groups = [g for g in self.groups if g.spec.kind == "mamba"]
        # Mamba prefix caching needs "align" mode, vLLM's default whenever caching is on.
        self.mamba_align = bool(self.mamba_groups) and enable_caching
        self.num_speculative_blocks = num_speculative_blocks if self.mamba_groups else 0
        # Intra-chunk prefill checkpoints, when every Mamba group exports them (align mode).
        self.mamba_checkpoint_alignment = None
        if self.mamba_align and all(g.spec.prefill_checkpoint_alignment is not None
                                    for g in self.mamba_groups):
            self.mamba_checkpoint_alignment = self.mamba_groups[0].spec.prefill_checkpoint_alignment
        # Flag groups holding the drafter; with none marked vLLM flags them all.
        flagged = {i for i, g in enumerate(groups) if g.eagle} if eagle_family else set()
        if eagle_family and (not flagged or not rules.per_group_eagle_flags):
            flagged = set(range(len(groups)))
        drop_groups = flagged if eagle_drop else set()
        self.replay_eagle_drop = bool(drop_groups)  # replay boundaries a block lower
        # Attention groups: groups with equal specs are looked up together.
        attn: list[list] = []  # [spec key, gids, use_eagle]
        for g in self.groups:
            key = (g.spec.kind, g.spec.block_size, g.spec.sliding_window)
            for entry in attn:
                if entry[0] == key:
                    entry[1].append(g.gid)
                    entry[2] = entry[2] or g.gid in drop_groups
                    break
            else:
                attn.append([key, [g.gid], g.gid in drop_groups])
        attn.sort(key=lambda e: e[0][0] != "full_attention")  # full attention first (stable)
        self.attention_groups = [(e[0][0], e[1], e[2]) for e in attn]
        for _, gids, use_eagle in self.attention_groups:
            for gid in gids:
                self.groups[gid].use_eagle = use_eagle
        self.is_simple_hybrid = (len(self.attention_groups) == 2
                                 and self.attention_groups[0][0] == "full_attention")
        if not enable_caching:
            self.attention_groups = []

    # -- hashes --------------------------------------------------------------------------

    def share_hashes(self, other: HybridKVCacheManager) -> None:
        """Hash blocks (fine and coarse) in ``other``'s id space (see
        ``KVCacheManager.share_hashes``); both must have the same groups and lookahead."""
        assert [g.spec for g in self.groups] == [g.spec for g in other.groups]
        assert self.hasher.lookahead == other.hasher.lookahead
        self.hasher, self._coarse = other.hasher, other._coarse

    def _group_keys(self, req: Request, g: _Group, fine: list[int]) -> list[int]:
        """The request's block keys for group ``g`` (group id folded in), extended lazily
        from ``fine``, its fine hashes (``hasher.block_hashes``, made once by the caller)."""
        keys = req.group_keys.setdefault(g.gid, [])
        s = g.block_size // self.hash_block_size
        num_groups = len(self.groups)
        for j in range(len(keys), len(fine) // s):
            if s == 1:
                h = fine[j]
            else:
                span = tuple(fine[j * s:(j + 1) * s])
                coarse = self._coarse.get(span)
                if coarse is None:  # coarse ids are in (-2^63, 0): never a fine id (hashing.py)
                    coarse = self._coarse[span] = -1 - len(self._coarse)
                h = coarse
            keys.append(h * num_groups + g.gid)
        return keys

    def _cached(self, keys_by_gid: dict[int, list[int]], gids: list[int], j: int) -> list[Block] | None:
        out = []
        for gid in gids:
            keys = keys_by_gid[gid]
            blk = self.pool.get_cached_block(keys[j]) if j < len(keys) else None
            if blk is None:
                return None
            out.append(blk)
        return out

    # -- prefix lookup -------------------------------------------------------------------

    def _full_attention_hit(self, keys, gids, max_length, drop, b):
        U = self.block_size
        blocks = {gid: [] for gid in gids}
        for j in range(max_length // b):
            cached = self._cached(keys, gids, j)
            if cached is None:
                break
            for gid, blk in zip(gids, cached):
                blocks[gid].append(blk)
        hit = len(blocks[gids[0]]) * b
        if drop and hit > 0:
            hit -= min(U, b)
        hit -= hit % U
        n = cdiv(hit, b)
        for lst in blocks.values():
            del lst[n:]
        return blocks, hit

    def _sliding_window_hit(self, keys, gids, max_length, drop, g: _Group):
        U, b, null = self.block_size, g.block_size, self.pool.null_block
        need = g.contiguous_blocks_for_hit(drop)
        post_pop = self.rules.swa_eagle_scan == "post_pop"
        max_blocks = max_length // b
        blocks = {gid: [null] * max_blocks for gid in gids}
        run, found = 0, False
        for i in range(max_blocks - 1, -1, -1):
            cached = self._cached(keys, gids, i)
            if cached is None:
                run = 0
                continue
            if run == 0 and b != U and (((i if drop and post_pop else i + 1) * b) % U):
                continue  # a run may only end where the (post-drop) length is aligned
            for gid, blk in zip(gids, cached):
                blocks[gid][i] = blk
            run += 1
            if run >= need:
                for lst in blocks.values():
                    del lst[i + run:]
                found = True
                break
        first = blocks[gids[0]]
        if not found:  # fall back to the leading run, re-aligned
            for lst in blocks.values():
                del lst[run:]
            while b != U and len(first) * b % U:
                for lst in blocks.values():
                    lst.pop()
        if drop and first:
            if b != U and self.rules.swa_eagle_scan == "assert":  # 0.19.0 :567-570
                raise EngineDeadError("AssertionError: aligned_length is not compatible with eagle now")
            for lst in blocks.values():
                lst.pop()
            while b != U and len(first) * b % U:
                for lst in blocks.values():
                    lst.pop()
        return blocks, len(first) * b

    def _mamba_hit(self, keys, gids, max_length, b):
        """The last cached state whose end is U-aligned, null-padded before it."""
        U, null = self.block_size, self.pool.null_block
        for i in range(max_length // b - 1, -1, -1):
            cached = self._cached(keys, gids, i)
            if cached is None or (b != U and (i + 1) * b % U):
                continue
            return {gid: [null] * i + [blk] for gid, blk in zip(gids, cached)}, (i + 1) * b
        return {gid: [] for gid in gids}, 0

    def hit_tokens(self, req: Request) -> int:
        """``get_computed_blocks(req)``'s hit length alone."""
        return self.get_computed_blocks(req)[1]

    def get_computed_blocks(self, req: Request) -> tuple[dict[int, list[Block]], int]:
        """Fixed-point intersection of every group's hit (vLLM's hybrid coordinator).

        Pure but for one record: ``req.shared_prefix_boundary``, the longest single-group hit
        when it exceeds the agreed one (0.32+ end a Mamba prefill chunk there)."""
        req.shared_prefix_boundary = 0
        if not self.attention_groups:
            return {}, 0
        fine = self.hasher.block_hashes(req, 1 << 62)
        keys = {g.gid: self._group_keys(req, g, fine) for g in self.groups}
        max_hit = req.num_tokens - 1
        lookup = self.rules.lookup
        # How far an EAGLE group may look past the candidate before dropping a block.
        horizon = len(req.block_hashes) * self.hash_block_size if lookup == "hashes" else max_hit
        hit_length = max_hit
        by_group: dict[int, list[Block]] = {}
        len_by_group: dict[int, int] = {}
        verified: set[int] = set()
        longest = 0
        while True:
            curr = hit_length
            for idx, (kind, gids, use_eagle) in enumerate(self.attention_groups):
                g = self.groups[gids[0]]
                if kind == "full_attention" and gids[0] in by_group:
                    if self.rules.cap_at_full_attention_hit:  # downward-closed: trim only
                        curr = min(curr, len_by_group[gids[0]])
                    else:
                        curr -= curr % g.block_size
                    continue
                if lookup == "spiral":
                    drop, max_length = use_eagle, curr
                else:
                    drop = use_eagle and idx not in verified
                    margin = drop and (kind != "mamba" or self.rules.mamba_eagle_margin)
                    max_length = min(curr + g.block_size, horizon) if margin else curr
                if kind == "full_attention":
                    blocks, new = self._full_attention_hit(keys, gids, max_length, drop, g.block_size)
                elif kind == "mamba":  # its finder never drops (draft models have no Mamba layers)
                    blocks, new = self._mamba_hit(keys, gids, max_length, g.block_size)
                else:
                    blocks, new = self._sliding_window_hit(keys, gids, max_length, drop, g)
                if drop:
                    verified.add(idx)
                elif new < curr:
                    verified.clear()
                curr = new
                for gid in gids:
                    by_group[gid] = blocks[gid]
                    len_by_group[gid] = new
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if self.is_simple_hybrid:
                break
        trim = self.attention_groups if self.rules.trim_all_full_groups else self.attention_groups[:1]
        for kind, gids, _ in trim:
            if kind == "full_attention":
                n = cdiv(hit_length, self.groups[gids[0]].block_size)
                for gid in gids:
                    del by_group[gid][n:]
        if longest > hit_length:
            req.shared_prefix_boundary = longest
        return by_group, hit_length

    # -- allocation ----------------------------------------------------------------------

    def _blocks_to_allocate(self, g: _Group, req_id: str, num_tokens: int, hit: list[Block],
                            total_computed: int, admission_cap: bool, main_tokens: int,
                            prefill_end: int, window_cap: bool) -> int:
        if g.spec.kind == "mamba":
            if hit and hit[-1].block_hash in g.cached_this_step:
                # Mamba can't rely on a state another request publishes in this very step:
                # report more than the pool holds so the request waits a step (#29387).
                return self.pool.num_gpu_blocks + 1
            if self.mamba_align:
                return self._mamba_align_blocks_to_allocate(g, req_id, main_tokens, hit,
                                                            total_computed, admission_cap,
                                                            prefill_end)
            num_tokens += g.block_size * self.num_speculative_blocks
        required = cdiv(num_tokens, g.block_size)
        if window_cap and g.spec.kind == "sliding_window":
            cap_tokens = min(g.spec.sliding_window - 1 + g.extra_retained + self.max_in_flight_tokens,
                             self.max_model_len)
            required = min(required, cdiv(cap_tokens, g.block_size) + 1)  # vLLM's admission cap
        held = len(g.tables.get(req_id, ()))
        if req_id in g.num_cached:
            return max(required - held, 0)
        skipped = g.num_skipped_tokens(total_computed) // g.block_size
        num_new = max(required - max(skipped, len(hit) + held), 0)
        skip_hit = max(0, skipped - held)
        return num_new + self._num_evictable(hit[skip_hit:])

    def _num_evictable(self, blocks: list[Block]) -> int:
        """Hit blocks that touching takes out of the free queue."""
        return sum(1 for blk in blocks if blk.ref_cnt == 0 and blk is not self.pool.null_block)

    def _mamba_align_blocks_to_allocate(self, g: _Group, req_id: str, main_tokens: int,
                                        hit: list[Block], total_computed: int,
                                        admission_cap: bool, prefill_end: int) -> int:
        """Align mode ignores lookahead slots (draft models have no Mamba layers): a first
        allocation needs the state block plus ``num_speculative_blocks``, later ones at most
        one block (the speculative blocks are reused), plus one for a checkpoint the chunk
        exports from inside (recorded for the allocation, unless this is the admission gate's
        count)."""
        nsb = self.num_speculative_blocks
        required = cdiv(main_tokens, g.block_size) + nsb
        num_new = required - len(hit) - len(g.tables.get(req_id, ()))
        checkpoint = 0
        if self.mamba_checkpoint_alignment is not None:
            checkpoint = mamba_checkpoint_position(main_tokens, self.block_size, self.eagle_drop,
                                                   self.hash_lookahead)
            if not self._needs_internal_checkpoint(g, req_id, total_computed, main_tokens,
                                                   checkpoint, prefill_end):
                checkpoint = 0
        if not admission_cap:
            if checkpoint:
                g.checkpoints[req_id] = (checkpoint, cdiv(main_tokens, g.block_size) - 2)
            else:
                g.checkpoints.pop(req_id, None)
        if num_new > 0:
            cap = (1 if req_id in g.allocated else 1 + nsb) + (checkpoint > 0)
            num_new = min(num_new, cap) if self.rules.mamba_min_cap else cap
        return num_new + self._num_evictable(hit)

    def _needs_internal_checkpoint(self, g: _Group, req_id: str, query_start: int, query_end: int,
                                   checkpoint: int, prefill_end: int) -> bool:
        """MambaManager._needs_internal_checkpoint: the chunk reaches ``prefill_end``, the
        layers can export ``checkpoint`` from inside it, and its block column is free."""
        if query_end < prefill_end:
            return False
        b = g.block_size
        if not mamba_checkpoint_exportable(query_start, query_end, checkpoint, self.hash_block_size,
                                           b, self.mamba_checkpoint_alignment):
            return False
        idx = cdiv(query_end, b) - 2
        table = g.tables.get(req_id, ())
        return idx >= 0 and (idx >= len(table) or table[idx] is self.pool.null_block or (
            req_id in g.allocated and idx >= len(table) - self.num_speculative_blocks))

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, hit: dict, total_computed: int = 0,
                               admission_cap: bool = False, main_tokens: int | None = None,
                               prefill_end: int = 0, counted: bool = True) -> int:
        """``admission_cap``: the full-sequence admission gate's count. ``prefill_end``: where
        the request's prefill ends; only the chunk reaching it exports a Mamba checkpoint from
        inside under the default retention (0), every chunk otherwise (vLLM then passes 0).
        ``counted``: the count vLLM checks, with the release's sliding-window cap where it
        applies (``HybridRules.swa_admission_cap``); False: the blocks the allocation takes."""
        main = num_tokens if main_tokens is None else main_tokens
        if self.retention_interval != 0:
            prefill_end = 0
        mode = self.rules.swa_admission_cap
        window_cap = counted and (mode == "always" or (admission_cap and mode == "gate"))
        return sum(self._blocks_to_allocate(g, req_id, num_tokens, hit.get(g.gid, []),
                                            total_computed, admission_cap, main, prefill_end,
                                            window_cap)
                   for g in self.groups)

    def _free_range(self, table: list[Block], first: int, last: int, past_nulls: bool,
                    skipped: bool = True) -> None:
        """Free ``table[first:last]`` newest first, leaving null blocks; stop at the first null
        block (everything before it was freed earlier) unless ``past_nulls``. ``skipped``:
        blocks the window or old states left behind (``skipped_unhashed_to_front``), not a
        Mamba state block copied forward."""
        null, freed = self.pool.null_block, []
        for i in range(last - 1, first - 1, -1):
            if table[i] is null:
                if past_nulls:
                    continue
                break
            freed.append(table[i])
            table[i] = null
        if freed:
            self.pool.free_blocks(freed, skipped and self.rules.skipped_unhashed_to_front)

    def remove_skipped_blocks(self, req_id: str, num_computed: int) -> None:
        """Free what each group no longer reads (newest first), leaving null blocks: blocks
        that slid out of a window, and Mamba states older than the last one."""
        for g in self.groups:
            table = g.tables.get(req_id)
            if table is None:
                continue
            mamba_align = g.spec.kind == "mamba" and self.mamba_align
            computed = num_computed
            if g.spec.kind == "mamba" and self.rules.mamba_skip_back_spec_blocks:
                # 0.19-0.25: pretend every draft of the last step gets rejected (async).
                computed = max(0, num_computed - self.num_speculative_blocks)
            skipped = g.num_skipped_tokens(computed)
            if skipped > 0:
                last = min(skipped // g.block_size, len(table))
                if mamba_align and self.rules.mamba_retire:
                    # 0.32+: past the null gaps prefill left between states, from where the
                    # last call stopped.
                    first = g.num_retired.get(req_id, 0)
                    if first < last:
                        self._free_range(table, first, last, past_nulls=True)
                        g.num_retired[req_id] = last
                else:
                    self._free_range(table, 0, last, past_nulls=False)
            if mamba_align:
                # The state of two steps ago was copied forward last step: free it.
                idx = g.last_state_idx.get(req_id)
                if idx is not None and idx < cdiv(computed, g.block_size) - 1:
                    self._free_range(table, idx, idx + 1, past_nulls=True, skipped=False)

    def allocate_slots(self, req: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: dict | None = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, reserved_blocks: int = 0
                       ) -> list[Block] | None:
        """As ``KVCacheManager.allocate_slots``, for every group at once (no KV connector
        yet: no external tokens)."""
        assert not (num_external_computed_tokens or delay_cache_blocks or reserved_blocks)
        hit = new_computed_blocks or {}
        local = req.num_computed_tokens + num_new_computed_tokens
        total, main, need, prefill_end = self._slots(req, local, num_new_tokens, num_lookahead_tokens)
        if full_sequence_must_fit:
            full = min(req.num_tokens, self.max_model_len)
            if self.num_blocks_to_allocate(req.req_id, full, hit, total, True,
                                           prefill_end=prefill_end) > self.pool.num_free_blocks:
                return None
        # Even if the allocation then fails; on the processed-token basis (in-flight steps
        # still read their window; 0.32 kv_cache_manager.py:552-559). Before 0.32 all computed
        # tokens count (0.22 :373-375): the scheduler keeps num_in_flight_tokens at 0 there.
        self.remove_skipped_blocks(req.req_id, max(0, total - req.num_in_flight_tokens))
        num_blocks = self.num_blocks_to_allocate(req.req_id, need, hit, local, main_tokens=main,
                                                 prefill_end=prefill_end)
        if num_blocks > self.pool.num_free_blocks:
            return None
        null = self.pool.null_block
        if any(hit.values()):
            for g in self.groups:  # touch every group's hit before allocating any block
                table = g.tables.setdefault(req.req_id, [])
                blocks = hit.get(g.gid, [])
                skipped = max(0, g.num_skipped_tokens(local)) // g.block_size
                blocks = blocks[skipped:]
                self.pool.touch(b for b in blocks if b is not null)
                table.extend([null] * skipped)
                table.extend(blocks)
                g.num_cached[req.req_id] = len(table)
        new_blocks = []
        for g in self.groups:
            table = g.tables.setdefault(req.req_id, [])
            if g.spec.kind == "mamba" and self.mamba_align:
                got = self._mamba_align_allocate(g, req.req_id, main, table)
            else:
                tokens = need + (g.block_size * self.num_speculative_blocks if g.spec.kind == "mamba" else 0)
                n = cdiv(tokens, g.block_size) - len(table)
                got = self.pool.get_new_blocks(n) if n > 0 else []
                table.extend(got)
            new_blocks.extend(got)
        if self.enable_caching:
            self.cache_blocks(req, min(total + num_new_tokens, req.num_tokens))
        return new_blocks

    def _slots(self, req: Request, local: int, num_new_tokens: int,
               num_lookahead_tokens: int) -> tuple[int, int, int, int]:
        """An allocation's token counts: computed tokens (capped), their end after the new
        tokens (``main``), the slots it needs (lookahead included), where the prefill ends."""
        total = min(local, self.max_model_len)
        main = total + num_new_tokens
        need = min(main + num_lookahead_tokens, self.max_model_len)
        return total, main, need, max(req.num_prompt_tokens, req.num_tokens - 1)

    def num_blocks_to_grow(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """Blocks ``allocate_slots(req, num_new_tokens, num_lookahead_tokens=...)`` takes for a
        running request (no hit), what ``remove_skipped_blocks`` frees first not counted."""
        local = req.num_computed_tokens
        _, main, need, prefill_end = self._slots(req, local, num_new_tokens, num_lookahead_tokens)
        return self.num_blocks_to_allocate(req.req_id, need, {}, local, main_tokens=main,
                                           prefill_end=prefill_end, counted=False)

    def decode_slack(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int | None:
        """``KVCacheManager.decode_slack`` for every group: the tokens a running request can
        gain, computed tokens and tokens alike, before ``allocate_slots`` acts in some group,
        each group's rules asked where they next act on its table as it is:

        * ``remove_skipped_blocks``: the skipped tokens (``num_skipped_tokens`` of the
          processed tokens, which grow with the computed ones) reach past the next block
          still held; a Mamba state of two steps ago once the tokens pass its block;
        * an allocation: the slots (lookahead, speculative blocks) pass the table's end;
        * ``cache_blocks``: ``_cacheable_tokens`` fills the next block to publish (found by
          bisection on the rule itself), a prompt-tail entry still to make, and in Mamba
          align mode a checkpoint to re-key while the cacheable tokens are at the prompt's.

        Early, never late: what it can't tell says now (a chunk longer than a Mamba block,
        which may export a checkpoint from inside; a checkpoint of the last call pending)."""
        rid, mml = req.req_id, self.max_model_len
        c, t = req.num_computed_tokens, req.num_tokens
        n, nsb, null = num_new_tokens, self.num_speculative_blocks, self.pool.null_block
        # Processed tokens: in steady decode at most one chunk is in flight (0.32+ async);
        # a longer one now (a prefill's last chunk) only makes this early.
        processed = c - min(req.num_in_flight_tokens, n)
        cached = min(c + n, t)  # what cache_blocks publishes up to
        at: list[int] = []  # where some rule acts (tokens from now; <= 0: now)
        for g in self.groups:
            table = g.tables.get(rid)
            if table is None:
                return 0
            b, kind, size = g.block_size, g.spec.kind, len(table)
            mamba = kind == "mamba"
            align = mamba and self.mamba_align
            if align and (rid in g.checkpoints or rid not in g.allocated
                          or (self.mamba_checkpoint_alignment is not None and n > b)):
                return 0
            # Frees: the blocks below the skipped tokens, newest first down to a null block
            # (past them from where the last call stopped, 0.32+ Mamba align).
            computed = processed - (nsb if mamba and self.rules.mamba_skip_back_spec_blocks else 0)
            skipped = g.num_skipped_tokens(max(0, computed))
            if kind != "full_attention":
                if align and self.rules.mamba_retire:
                    first = g.num_retired.get(rid, 0)
                else:
                    first = max(0, min(skipped // b, size) - 1)
                j = next((i for i in range(first, size) if table[i] is not null), None)
                if j is not None:
                    at.append((j + 1) * b - skipped)
            if align:
                idx = g.last_state_idx.get(rid)
                if idx is not None and idx < size and table[idx] is not null:
                    at.append((idx + 1) * b + 1 - max(0, computed))
                at.append((size - nsb) * b + 1 - (c + n))  # the running state's next block
            else:
                extra = b * nsb if mamba else 0
                if size * b - extra < mml:
                    at.append(size * b - extra + 1 - (c + n + num_lookahead_tokens))
            if not self.enable_caching:
                continue
            # Publications: the next block to publish, a prompt-tail entry not made yet.
            at.append(self._cacheable_reach(g, cached, (g.num_cached.get(rid, 0) + 1) * b))
            if kind == "full_attention" and self.rules.partial_tail_hashes \
                    and b != self.hash_block_size:
                tail = self._partial_tail(req, g, 1 << 62)
                if tail is not None and not self.pool.has_entry(tail[0], tail[1]):
                    at.append(self._cacheable_reach(g, cached, tail[2]))
            if align and self.rules.mamba_tail_rekey != "never":
                # The prompt's checkpoint, re-keyed at every call while the cacheable tokens
                # stay there (``decode_marks``): when they reach it, and pass it.
                latest = mamba_checkpoint_position(req.num_prompt_tokens, self.hash_block_size,
                                                   self.eagle_drop, self.hash_lookahead)
                now = self._cacheable_tokens(g, cached)
                if now <= latest:
                    at.append(self._cacheable_reach(g, cached, latest + (now == latest)))
        return max(0, min(at)) if at else None

    def _cacheable_reach(self, g: _Group, num_tokens: int, target: int) -> int:
        """The fewest tokens past ``num_tokens`` at which ``_cacheable_tokens`` reaches
        ``target`` (it never falls as the tokens grow, and never exceeds them: bisected on the
        rule itself)."""
        lo = max(0, target - num_tokens)
        hi = max(lo, target + self.block_size + self.num_reprefillable - num_tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._cacheable_tokens(g, num_tokens + mid) >= target:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def prompt_published(self, req: Request) -> bool:
        """Whether every group has published (or passed, where it keeps only some) every
        prompt block the request's allocations publish."""
        la = self.hasher.lookahead
        return all((g.num_cached.get(req.req_id, 0) + 1) * g.block_size + la > req.num_prompt_tokens
                   for g in self.groups)

    def _mamba_align_allocate(self, g: _Group, req_id: str, main_tokens: int,
                              table: list[Block]) -> list[Block]:
        """MambaManager.allocate_new_blocks in align mode: the running state goes in the
        block of the last token, the speculative blocks after it (moved forward, not
        reallocated, on later steps); everything before is null, except states kept as
        checkpoints until ``remove_skipped_blocks`` frees them."""
        nsb, null = self.num_speculative_blocks, self.pool.null_block
        required = cdiv(main_tokens, g.block_size) + nsb
        checkpoint = 1 if req_id in g.checkpoints else 0  # its column gets a block, not null
        if required <= len(table) and not checkpoint:
            if self.rules.mamba_noop_marks_allocated:
                g.allocated.add(req_id)
            return []
        prev = len(table)
        allocated = req_id in g.allocated
        if allocated:  # the running state sits just before the speculative blocks
            g.last_state_idx[req_id] = prev - 1 - nsb
        elif prev > 0:  # a prefix hit: its last block holds the hit state
            g.last_state_idx[req_id] = prev - 1
        num_skipped = required - nsb - 1
        if prev < num_skipped:
            table.extend([null] * max(0, num_skipped - checkpoint - prev))
        if allocated:
            for idx in range(prev - nsb, prev):
                if idx >= num_skipped - checkpoint:
                    break
                table.append(table[idx])
                table[idx] = null
        got = self.pool.get_new_blocks(max(required - len(table), 0))
        table.extend(got)
        g.allocated.add(req_id)
        return got

    def new_step_starts(self) -> None:
        for g in self.mamba_groups:
            g.cached_this_step.clear()

    # -- caching -------------------------------------------------------------------------

    def _cacheable_tokens(self, g: _Group, num_computed: int) -> int:
        if self.rules.writes == "all":
            return num_computed
        U = self.block_size
        aligned = num_computed - num_computed % U
        if g.use_eagle and aligned > 0 and self.rules.writes == "eagle_extra":
            fin = max(0, num_computed - self.num_reprefillable)
            return min(fin, fin - fin % U + g.block_size)
        return aligned

    def _reachable_boundaries(self, req: Request, g: _Group) -> list[int]:
        """Token positions whose hit tail a sparse-retention group keeps: the prompt's replay
        boundaries and the shared-prefix junction its lookup found (SingleTypeKVCacheManager.
        cache_blocks, 0.32+)."""
        out = list(replay_boundaries(req.num_prompt_tokens, self.block_size,
                                     self.replay_eagle_drop and self.rules.replay_boundaries_eagle))
        junction = req.shared_prefix_boundary if self.rules.retention_junction else 0
        if junction:
            out.append(junction)
            if g.use_eagle and self.rules.junction_eagle_tail:
                out.append(junction - g.block_size)
        return out

    def _mask(self, g: _Group, boundaries: Sequence[int], start: int,
              end: int) -> list[bool] | None:
        """Which of blocks ``start..end`` a sliding-window or Mamba group publishes (vLLM's
        reachable_block_mask): only blocks a future ``U``-aligned hit can read, at every ``U``
        boundary (dense), once per retention interval, and at the reachable ``boundaries``
        (token positions; see ``_reachable_boundaries``)."""
        kind, interval = g.spec.kind, self.retention_interval
        if self.rules.writes == "all" or kind == "full_attention" or (
                kind == "mamba" and (interval is None or not self.mamba_align
                                     or not self.rules.mamba_retention)):
            return None
        b, U = g.block_size, self.block_size
        mask = [False] * (end - start)
        if kind == "mamba":  # a hit reads the one state block ending on its boundary
            if interval:
                per_segment = interval // b
                if per_segment <= 1:
                    return None
                first = (start + per_segment) // per_segment * per_segment - 1
                for i in range(first - start, len(mask), per_segment):
                    mask[i] = True
            for t in boundaries:
                i = t // U * U // b - 1
                if start <= i < end:
                    mask[i - start] = True
            return mask
        use_eagle = g.use_eagle and self.rules.writes == "eagle_extra"
        need = g.contiguous_blocks_for_hit(use_eagle)
        shift = 1 if use_eagle else 0  # an EAGLE run ends on the block past the boundary
        segment = U if interval is None else interval
        if segment:
            per_segment = segment // b
            if need >= per_segment:
                return None
            for i in range(start, end):
                mask[i - start] = i >= shift and (i - shift) % per_segment >= per_segment - need
        if interval is not None:
            for t in boundaries:
                last = t // U * U // b + shift
                for i in range(max(start, last - need), min(end, last)):
                    mask[i - start] = True
        return mask

    def cache_blocks(self, req: Request, num_computed: int) -> None:
        if not self.enable_caching:
            return
        fine = self.hasher.block_hashes(req, 1 << 62)  # (the prompt tail and re-keys read them)
        for g in self.groups:
            num_cached = g.num_cached.get(req.req_id, 0)
            cacheable = self._cacheable_tokens(g, num_computed)
            num_full = cacheable // g.block_size
            if num_cached < num_full:  # (else the group's keys needn't be made yet)
                keys = self._group_keys(req, g, fine)
                num_full = min(num_full, len(keys))
                if num_cached < num_full:
                    self._cache_full(req, g, keys, num_cached, num_full)
            if (self.rules.partial_tail_hashes and g.spec.kind == "full_attention"
                    and g.block_size != self.hash_block_size):
                self._cache_partial_tail(req, g, cacheable)
            if g.spec.kind != "mamba":
                continue
            if self.mamba_align and self.rules.mamba_tail_rekey != "never":
                self._rekey_mamba_checkpoint(req, g, cacheable)
            if num_cached < num_full:  # every state block of the range that carries a hash now
                table, null = g.tables[req.req_id], self.pool.null_block
                g.cached_this_step.update(h for i in range(num_cached, num_full)
                                          if table[i] is not null
                                          and (h := table[i].block_hash) is not None)

    def _rekey_mamba_checkpoint(self, req: Request, g: _Group, num_tokens: int) -> None:
        """MambaManager._cache_partial_tail_block: the checkpoint this step's chunk exports
        from inside is keyed at its position, or unpublished when nothing keeps it (neither
        the prompt's checkpoint, nor retained, nor the junction); without one, the state at
        the prompt's checkpoint position is (re-)registered under that prefix's hash. Either
        counts as published in this step."""
        internal = g.checkpoints.get(req.req_id)
        if internal is not None:
            position, idx = internal
            blk = g.tables[req.req_id][idx]
            prompt_checkpoint = position == mamba_checkpoint_position(
                req.num_prompt_tokens, self.block_size, self.eagle_drop, self.hash_lookahead)
            retained = False
            if position % g.block_size == 0:
                i = position // g.block_size - 1
                mask = self._mask(g, (), i, i + 1)
                retained = mask is None or mask[0]
            if not (prompt_checkpoint or retained or position == req.shared_prefix_boundary):
                self.pool.evict(blk)  # the running state overwrites it
                return
            if blk.hash_tokens == position:
                return
            key = self._prefix_key(req, g, position)
            self.pool.cache_partial_block(blk, key, position, replace_existing_hashes=True)
            g.cached_this_step.add(key)
            return
        rekey = self._prompt_checkpoint_rekey(req, g, num_tokens)
        if rekey is not None:
            blk, key = rekey
            self.pool.cache_partial_block(blk, key, num_tokens)
            g.cached_this_step.add(key)

    def _prompt_checkpoint_rekey(self, req: Request, g: _Group,
                                 num_tokens: int) -> tuple[Block, int] | None:
        """The state block and key ``_rekey_mamba_checkpoint`` (re-)registers at the prompt's
        checkpoint when ``num_tokens`` are cacheable and no checkpoint is exported from
        inside the chunk; None: none."""
        H = self.hash_block_size
        if num_tokens <= 0 or num_tokens % H:
            return None
        latest = mamba_checkpoint_position(req.num_prompt_tokens, H, self.eagle_drop,
                                           self.hash_lookahead)
        if num_tokens != latest or num_tokens // H > len(req.block_hashes):
            return None
        table = g.tables.get(req.req_id, ())
        idx = cdiv(num_tokens, g.block_size) - 1
        if idx >= len(table) or table[idx] is self.pool.null_block:
            return None
        blk = table[idx]
        if self.rules.mamba_tail_rekey == "unless_keyed" and blk.hash_tokens == num_tokens:
            return None
        return blk, self._prefix_key(req, g, num_tokens)

    def decode_marks(self, req: Request, num_new_tokens: int) -> list[int]:
        """The keys the request's ``allocate_slots(req, num_new_tokens)`` marks published in
        every step while ``decode_slack`` says nothing else acts: a Mamba state re-keyed at
        the prompt's checkpoint (align mode), for ``mark_published`` to mark in its stead.
        Pure."""
        if not (self.mamba_align and self.enable_caching and self.rules.mamba_tail_rekey != "never"):
            return []
        cached = min(req.num_computed_tokens + num_new_tokens, req.num_tokens)
        out = []
        for g in self.mamba_groups:
            if req.req_id not in g.checkpoints:
                rekey = self._prompt_checkpoint_rekey(req, g, self._cacheable_tokens(g, cached))
                if rekey is not None:
                    out.append(rekey[1])
        return out

    def mark_published(self, keys: Iterable[int]) -> None:
        """Mark ``decode_marks``' keys published in this step (each names its group)."""
        for key in keys:
            self.groups[key % len(self.groups)].cached_this_step.add(key)

    def _prefix_key(self, req: Request, g: _Group, num_tokens: int) -> int:
        """Group ``g``'s map key for the prefix of ``num_tokens`` (a multiple of the hash block):
        the fine hash ending there, with the group id folded in (a partial entry's key)."""
        return req.block_hashes[num_tokens // self.hash_block_size - 1] * len(self.groups) + g.gid

    def _cache_full(self, req: Request, g: _Group, keys: list[int], num_cached: int,
                    num_full: int) -> None:
        boundaries = self._reachable_boundaries(req, g) if g.spec.kind != "full_attention" else ()
        mask = self._mask(g, boundaries, num_cached, num_full)
        table = g.tables[req.req_id]
        if mask is None:
            self.pool.cache_full_blocks(table, keys, num_cached, num_full, g.block_size)
        else:
            for i, keep in zip(range(num_cached, num_full), mask):
                if keep:
                    self.pool.cache_full_blocks(table, keys, i, i + 1, g.block_size)
        g.num_cached[req.req_id] = num_full

    def _cache_partial_tail(self, req: Request, g: _Group, num_tokens: int) -> None:
        """0.32+: a full-attention block coarser than the hash unit that holds the end of the
        prompt is also published under the fine hash of that end (the prompt-tail entry that
        fine-grained lookups can hit); this changes where the block goes when freed."""
        tail = self._partial_tail(req, g, num_tokens)
        if tail is not None:
            blk, key, boundary = tail
            self.pool.cache_partial_block(blk, key, boundary)

    def _partial_tail(self, req: Request, g: _Group, num_tokens: int) -> tuple[Block, int, int] | None:
        """The prompt-tail entry ``_cache_partial_tail`` makes with ``num_tokens`` cacheable:
        (block, key, boundary), or None."""
        H = self.hash_block_size
        limit = req.num_prompt_tokens
        if self.rules.partial_tail_limit == "resend" and not g.use_eagle:
            limit -= 1
        boundary = min(limit // H, len(req.block_hashes)) * H
        if boundary == 0 or boundary > num_tokens or boundary % g.block_size == 0:
            return None
        table = g.tables.get(req.req_id, ())
        idx = boundary // g.block_size
        if idx >= len(table):
            return None
        return table[idx], self._prefix_key(req, g, boundary), boundary

    # -- freeing and checks --------------------------------------------------------------

    def free(self, req: Request) -> None:
        """Each group frees its table tail first, group by group (null blocks stay out)."""
        for g in self.groups:
            table = g.tables.pop(req.req_id, [])
            g.num_cached.pop(req.req_id, None)
            g.allocated.discard(req.req_id)
            g.last_state_idx.pop(req.req_id, None)
            g.num_retired.pop(req.req_id, None)
            g.checkpoints.pop(req.req_id, None)
            self.pool.free_blocks(reversed(table),  # null blocks are skipped there
                                  g.spec.kind == "sliding_window" and self.rules.skipped_unhashed_to_front)

    def block_ids(self, req_id: str) -> list[list[int]]:
        return [[blk.block_id for blk in g.tables.get(req_id, ())] for g in self.groups]

    @property
    def req_to_blocks(self) -> dict[str, list[Block]]:
        """All tables, flattened per request (for invariant checks and emptiness tests)."""
        out: dict[str, list[Block]] = {}
        for g in self.groups:
            for rid, table in g.tables.items():
                out.setdefault(rid, []).extend(table)
        return out

    def check_invariants(self, held=()) -> None:
        assert not held  # (frees are set aside only with a KV connector: one group)
        refs: dict[int, int] = {}
        null = self.pool.null_block
        for g in self.groups:
            for table in g.tables.values():
                for blk in table:
                    if blk is not null:
                        refs[blk.block_id] = refs.get(blk.block_id, 0) + 1
        self.pool.check_invariants(refs)
