"""The KV-cache manager for one full-attention group (``vllm/v1/core/kv_cache_manager.py``).

    | < computed > | < new hit > | < new tokens > | < lookahead > |
                   |            < to be allocated >               |
                   | < cached at schedule time, up to num_tokens > |

``get_computed_blocks`` finds the longest cached prefix (capped at ``num_tokens - 1`` so the
last token is recomputed for its logits); ``allocate_slots`` gates admission on the whole
prompt fitting, touches the hit blocks, pops new blocks from the free queue and publishes the
hashes of blocks that this step fills (before the forward pass, so a request examined later
in the same step already hits them); ``free`` releases a request's table tail first.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import takewhile
from typing import Any, Protocol, Self

from kvsim.kv.hashing import BlockHasher
from kvsim.kv.pool import Block, BlockPool
from kvsim.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager(Protocol):
    """The contract the scheduler plans through, vLLM's ``KVCacheManager`` interface: this
    module's ``KVCacheManager`` for one full-attention group, ``kvsim.kv.hybrid``'s
    ``HybridKVCacheManager`` for several. A hit (``get_computed_blocks``) is handed back to
    ``allocate_slots`` as the manager returned it."""

    pool: BlockPool
    block_size: int  # the scheduler's block size (hybrid: the lcm of the groups')
    max_model_len: int
    enable_caching: bool
    eagle_drop: bool
    num_reprefillable: int
    mamba_align: bool
    hasher: BlockHasher

    @property
    def req_to_blocks(self) -> dict[str, list[Block]]: ...

    def share_hashes(self, other: Self) -> None: ...

    def get_computed_blocks(self, req: Request) -> tuple[Any, int]: ...

    def hit_tokens(self, req: Request) -> int:
        """``get_computed_blocks(req)``'s hit length alone (a router's read)."""
        ...

    def allocate_slots(self, req: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, reserved_blocks: int = 0
                       ) -> list[Block] | None: ...

    def cache_blocks(self, req: Request, num_tokens: int, /) -> None: ...

    def num_blocks_to_grow(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """Blocks ``allocate_slots(req, num_new_tokens, ...)`` takes for a running request
        (no hit), frees before it not counted."""
        ...

    def decode_slack(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int | None:
        """Tokens a steadily decoding request can gain before its ``allocate_slots`` acts
        (0: now; None: never); may be early, never late (a fast path calls it then)."""
        ...

    def prompt_published(self, req: Request) -> bool:
        """Whether the request's allocations have published every prompt block they will."""
        ...

    def decode_marks(self, req: Request, num_new_tokens: int) -> list[int]:
        """Keys its ``allocate_slots`` marks published at every step of ``decode_slack``'s
        stretch (a fast path marks them with ``mark_published`` instead)."""
        ...

    def mark_published(self, keys: Iterable[int]) -> None: ...

    def free(self, req: Request) -> None: ...

    def new_step_starts(self) -> None: ...

    def block_ids(self, req_id: str) -> Any: ...

    def check_invariants(self, held: Iterable[list[Block]] = ()) -> None: ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int,
                 enable_caching: bool, eagle_drop: bool = False, hash_lookahead: int = 0,
                 num_reprefillable: int = 0):
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # EAGLE/MTP without lookahead hashes: a hit gives back its last matched block, which
        # the drafter must recompute (vLLM #17137).
        self.eagle_drop = eagle_drop
        # Multi-module MTP may re-prefill the last (prefill lookahead - 1) tokens: not cached.
        self.num_reprefillable = num_reprefillable
        self.hasher = BlockHasher(block_size, hash_lookahead)
        self.req_to_blocks: dict[str, list[Block]] = {}
        # Blocks of a request already published in the hash map (vLLM's num_cached_block);
        # present only once the request has been through cache_blocks or a hit.
        self.num_cached_block: dict[str, int] = {}

    mamba_align = False  # no Mamba group: the scheduler never aligns chunks for one

    def share_hashes(self, other: KVCacheManager) -> None:
        """Hash blocks in ``other``'s id space, so that a request's block hashes mean the same
        on both engines (as vLLM's content hashes do on every replica of a deployment).
        Both must hash alike (block size, lookahead)."""
        assert (self.hasher.block_size, self.hasher.lookahead) == (
            other.hasher.block_size, other.hasher.lookahead)
        self.hasher = other.hasher

    def new_step_starts(self) -> None:
        """Nothing to reset for a single full-attention group."""

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest prefix hit for a waiting request: (blocks, hit length in tokens). Pure."""
        if not self.enable_caching:
            return [], 0
        hashes, n = self._hit(req)
        get = self.pool.get_cached_block
        hit: list[Block] = [get(h) for h in hashes[:n]]  # type: ignore[misc]  # all published
        return hit, n * self.block_size

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int,
                               new_computed_blocks: list[Block]) -> int:
        """Blocks that giving ``req_id`` ``num_tokens`` slots would take from the free queue. Pure."""
        required = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(req_id, ()))
        if req_id in self.num_cached_block:
            # Held may exceed required after rejected drafts.
            return max(required - held, 0)
        num_new = max(required - (len(new_computed_blocks) + held), 0)
        # Touching an unreferenced hit block takes it out of the free queue too.
        return num_new + sum(1 for blk in new_computed_blocks if blk.ref_cnt == 0)

    def _hit(self, req: Request) -> tuple[list[int], int]:
        """The request's block hashes, and how many of them from the start a lookup hits (the
        longest run of published ones, walked in C; the last matched one given back under
        the EAGLE drop). The last token is never a hit (its logits are needed)."""
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self.hasher.block_hashes(req, max_blocks)
        n = len(list(takewhile(self.pool.cached.__contains__,
                               hashes[:max_blocks] if len(hashes) > max_blocks else hashes)))
        if self.eagle_drop and n:
            n -= 1
        return hashes, n

    def hit_tokens(self, req: Request) -> int:
        """``get_computed_blocks(req)``'s hit length alone. Pure."""
        return self._hit(req)[1] * self.block_size if self.enable_caching else 0

    def num_blocks_to_grow(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """Blocks ``allocate_slots(req, num_new_tokens, num_lookahead_tokens=...)`` takes from
        the free queue for a running request (no hit). Pure."""
        return self.num_blocks_to_allocate(req.req_id, min(
            req.num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len), [])

    def decode_slack(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int | None:
        """How many tokens a running request can gain, its computed tokens and its tokens
        alike (steady decode), before ``allocate_slots(req, num_new_tokens,
        num_lookahead_tokens=...)`` acts: a block taken when the slots pass its table's end,
        a block published when its tokens (and the lookahead its hash needs) fill it. 0: it
        acts now; None: never. Pure."""
        b = self.block_size
        held = len(self.req_to_blocks[req.req_id]) * b
        slack = None
        if held < self.max_model_len:
            slack = max(0, held + 1 - req.num_computed_tokens - num_new_tokens - num_lookahead_tokens)
        if self.enable_caching:
            full = (self.num_cached_block.get(req.req_id, 0) + 1) * b
            fill = max(0, full + max(self.num_reprefillable, self.hasher.lookahead) - req.num_tokens)
            slack = fill if slack is None else min(slack, fill)
        return slack

    def decode_marks(self, req: Request, num_new_tokens: int) -> list[int]:
        """None here (``HybridKVCacheManager.decode_marks``: Mamba's re-keyed checkpoints)."""
        return []

    def mark_published(self, keys: Iterable[int]) -> None:
        """Nothing to mark: a lookup here reads no step's publications."""

    def prompt_published(self, req: Request) -> bool:
        """Whether every block of the prompt that the request's allocations publish is
        published (a later one holds an output token: no other request can share it)."""
        return ((self.num_cached_block.get(req.req_id, 0) + 1) * self.block_size
                + self.hasher.lookahead > req.num_prompt_tokens)

    def allocate_slots(self, req: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[Block] | None = None,
                       num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, reserved_blocks: int = 0
                       ) -> list[Block] | None:
        """Give ``req`` slots for ``num_new_tokens`` (+ lookahead); None if the pool can't.

        Mutates the pool and the request's block table only on success. With
        ``full_sequence_must_fit`` (vLLM's ``scheduler_reserve_full_isl``), a request is
        admitted only if blocks for its whole ``num_tokens`` fit, not just this chunk.
        ``num_external_computed_tokens`` follow the local hit and get fresh blocks (a KV
        connector fills them); ``delay_cache_blocks`` leaves publishing them until the load
        is done; ``reserved_blocks`` must stay free (other asynchronous loads' reservations).
        """
        mml = self.max_model_len
        total_computed = min(req.num_computed_tokens + num_new_computed_tokens
                             + num_external_computed_tokens, mml)
        if not new_computed_blocks and not full_sequence_must_fit and not num_external_computed_tokens:
            # The common case, a running request within the blocks it holds: nothing to
            # allocate, perhaps blocks to publish (the same steps as below, written tight).
            table = self.req_to_blocks.get(req.req_id)
            need = total_computed + num_new_tokens + num_lookahead_tokens
            if table is not None and -(-(need if need < mml else mml) // self.block_size) <= len(table):
                if self.enable_caching:
                    upto = total_computed + num_new_tokens
                    tokens = req.num_prompt_tokens + req.num_output_tokens
                    upto = upto if upto < tokens else tokens
                    if ((upto - self.num_reprefillable) // self.block_size
                            > self.num_cached_block.get(req.req_id, 0)):
                        self.cache_blocks(req, upto)
                return []
        hit = new_computed_blocks or []
        free = self.pool.num_free_blocks
        if full_sequence_must_fit:
            full = min(req.num_tokens, self.max_model_len)
            if self.num_blocks_to_allocate(req.req_id, full, hit) > free:
                return None
        num_tokens_need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens, mml)
        if self.num_blocks_to_allocate(req.req_id, num_tokens_need_slot, hit) > free - reserved_blocks:
            return None
        table = self.req_to_blocks.setdefault(req.req_id, [])
        if hit:
            self.pool.touch(hit)
            table.extend(hit)
            self.num_cached_block[req.req_id] = len(table)
        num_new_blocks = cdiv(num_tokens_need_slot, self.block_size) - len(table)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        table.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            # Drafts are never cached: the count stops at num_tokens.
            self.cache_blocks(req, min(total_computed + num_new_tokens, req.num_tokens))
        return new_blocks

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish the hashes of the request's full blocks up to ``num_tokens`` (caching on)."""
        num_cached = self.num_cached_block.get(req.req_id, 0)
        # (A negative count floors below num_cached: nothing to publish.)
        num_full = (num_tokens - self.num_reprefillable) // self.block_size
        if num_cached >= num_full or not self.enable_caching:
            return
        hashes = req.block_hashes
        if len(hashes) < num_full:  # (else block_hashes would return them as they are)
            hashes = self.hasher.block_hashes(req, num_full)
        self.publish_blocks(req, min(num_full, len(hashes)))  # lookahead hashes trail the tokens

    def publish_blocks(self, req: Request, num_full: int) -> None:
        """Publish the request's first ``num_full`` blocks, their hashes already made."""
        num_cached = self.num_cached_block.get(req.req_id, 0)
        if num_full > num_cached:
            self.pool.cache_full_blocks(self.req_to_blocks[req.req_id], req.block_hashes,
                                        num_cached, num_full, self.block_size)
            self.num_cached_block[req.req_id] = num_full

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head."""
        self.pool.free_blocks(reversed(self.pop_blocks_for_free(req)))

    def pop_blocks_for_free(self, req: Request) -> list[Block]:
        """Forget the request's blocks and return them, in allocation order, for the caller
        to free later (tail first)."""
        self.num_cached_block.pop(req.req_id, None)
        return self.req_to_blocks.pop(req.req_id, [])

    def forget_unused_hashes(self, live_requests: Iterable[Request], held: Iterable[int] = ()) -> None:
        """Let the hasher drop the keys that neither a pool block nor ``live_requests`` (every
        request not finished) nor ``held`` (a KV connector's tier) holds
        (``BlockHasher.forget_all_but``)."""
        live = {blk.block_hash for blk in self.pool.blocks if blk.block_hash is not None}
        live.update(held)
        for r in live_requests:
            live.update(r.block_hashes)
        self.hasher.forget_all_but(live)

    def block_ids(self, req_id: str) -> list[int]:
        return [blk.block_id for blk in self.req_to_blocks.get(req_id, ())]

    def check_invariants(self, held: Iterable[list[Block]] = ()) -> None:
        """The pool's invariants, with ref counts checked against the block tables (and
        ``held``: tables set aside, not yet freed)."""
        refs: dict[int, int] = {}
        for table in (*self.req_to_blocks.values(), *held):
            for blk in table:
                if blk is not self.pool.null_block:
                    refs[blk.block_id] = refs.get(blk.block_id, 0) + 1
        self.pool.check_invariants(refs)
