"""The block pool: ref-counted blocks, the free queue, the prefix-cache hash map.

Mirrors ``vllm/v1/core/block_pool.py``:

    free queue  head -> [evicted first ... evicted last] <- tail
    block 0     the null block: never free, never allocated, never hashed

* ``get_new_blocks`` pops from the head; a popped block that still carries a hash leaves
  the hash map there and then (the only eviction point: eviction is lazy).
* ``free_blocks`` takes blocks in eviction order (the manager passes a request's table
  reversed, so its tail is evicted before its head). A block reaching ``ref_cnt == 0`` keeps
  its hash and stays hittable; where the release says so (``Semantics.free_unhashed_to_front``)
  unhashed blocks are put at the head for immediate reuse, hashed ones at the tail (LRU).
* ``touch`` (a prefix hit) takes a free block out of the queue without reordering the rest.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

from kvsim.errors import EngineDeadError, InvariantError


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "hash_tokens", "stale")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.hash_tokens = 0  # prefix length the primary hash covers
        self.stale = 0  # its entries in the free queue that no longer count (FreeQueue)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeQueue:
    """vLLM's free block queue (a doubly linked list there), head first.

    A deque of blocks. A block taken out of the middle (a prefix hit) leaves its entry
    behind, stale, and counts it (``Block.stale``); a block's stale entries are always ahead
    of its live one (a block with stale entries is never put at the head), so an entry
    reaching the head is stale exactly when its block still counts some. Stale entries are
    dropped when they outnumber the live ones. Iteration gives the queued block ids, head
    first."""

    __slots__ = ("_q", "_n", "_slack")

    def __init__(self, blocks: Sequence[Block] = (), slack: int = 1024):
        self._q: deque[Block] = deque()
        self._slack = slack  # stale entries tolerated beyond as many as there are queued blocks
        self._n = 0
        self.extend(blocks)

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        skipped: dict[Block, int] = {}
        for blk in self._q:
            k = skipped.get(blk, 0)
            if k < blk.stale:
                skipped[blk] = k + 1
            else:
                yield blk.block_id

    def entries(self) -> Counter[Block]:
        """For checks: how many entries each block has, stale ones included."""
        return Counter(self._q)

    def extend(self, blocks: Sequence[Block]) -> None:
        """Queue ``blocks`` at the tail, in order."""
        self._q.extend(blocks)
        self._n += len(blocks)

    def extend_front(self, blocks: list[Block]) -> None:
        """Queue ``blocks`` at the head, in order (the first becomes the head)."""
        if any(blk.stale for blk in blocks):
            self._compact()  # (their stale entries must not trail their new ones)
        self._q.extendleft(reversed(blocks))
        self._n += len(blocks)

    def take(self, n: int) -> list[Block]:
        """Dequeue ``n`` blocks from the head (there must be that many)."""
        popleft = self._q.popleft
        if len(self._q) == self._n:  # no stale entries
            out = [popleft() for _ in range(n)]
        else:
            out = []
            for _ in range(n):
                blk = popleft()
                while blk.stale:
                    blk.stale -= 1
                    blk = popleft()
                out.append(blk)
        self._n -= n
        return out

    def remove(self, blk: Block) -> None:
        """Dequeue a queued block wherever it is."""
        blk.stale += 1
        self._n -= 1
        if len(self._q) > 2 * self._n + self._slack:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries."""
        live = []
        for blk in self._q:
            if blk.stale:
                blk.stale -= 1
            else:
                live.append(blk)
        self._q = deque(live)


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, free_unhashed_to_front: bool):
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.free_unhashed_to_front = free_unhashed_to_front
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeQueue(self.blocks[1:])
        # hash -> the block, or {block_id: block} in insertion order when the same content
        # was computed twice (vLLM does not de-duplicate; a lookup returns the oldest).
        self.cached: dict[int, Block | dict[int, Block]] = {}
        # Further keys of a block beyond its primary hash (hybrid partial-tail entries).
        self.extra_hashes: dict[int, set[int]] = {}

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """vLLM's KV usage: ``1 - free / (num_gpu_blocks - 1)``; cached free blocks count as free."""
        return self.usage_at(len(self.free_queue))

    def usage_at(self, num_free: int) -> float:
        """``usage()`` when ``num_free`` blocks are free."""
        return 1.0 - num_free / (self.num_gpu_blocks - 1)

    def get_cached_block(self, block_hash: int) -> Block | None:
        entry = self.cached.get(block_hash)
        if entry is None or isinstance(entry, Block):
            return entry
        return next(iter(entry.values()))

    # -- mutations -----------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Pop ``num_blocks`` from the head, evicting any hash they carry; ref_cnt becomes 1.
        More than are free: vLLM's pool raises, and its engine dies (the caller's count was
        wrong: a release's bug, or kvsim's, which the oracle then tells apart)."""
        if num_blocks > len(self.free_queue):
            raise EngineDeadError(f"ValueError: Cannot get {num_blocks} free blocks from the pool")
        out = self.free_queue.take(num_blocks)
        cached, plain = self.cached, not self.extra_hashes
        for blk in out:
            h = blk.block_hash
            if h is not None:
                if plain and cached.get(h) is blk:  # the common case: one key, its only block
                    del cached[h]
                    blk.block_hash, blk.hash_tokens = None, 0
                else:
                    self._remove_hashes(blk)
            blk.ref_cnt = 1
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """A prefix hit: take each block out of the free queue if unreferenced, ref_cnt += 1."""
        queue = self.free_queue
        for blk in blocks:
            if blk.ref_cnt == 0:
                queue.remove(blk)
            blk.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[Block], unhashed_to_front: bool = False) -> None:
        """ref_cnt -= 1 for each block, given in eviction order; released blocks rejoin the queue
        (``unhashed_to_front``: those without a hash at the front, as the pool's own rule puts
        them where the release has it; 0.23 ``free_blocks(..., prepend=True)``)."""
        to_front: list[Block] = []
        to_tail: list[Block] = []
        null = self.null_block
        front_if_unhashed = self.free_unhashed_to_front or unhashed_to_front
        all_to_front = front_if_unhashed and not self.enable_caching
        for blk in ordered_blocks:
            if blk is null:
                continue
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if all_to_front or (front_if_unhashed and blk.block_hash is None):
                    to_front.append(blk)
                else:
                    to_tail.append(blk)
        if to_front:
            self.free_queue.extend_front(to_front)
        self.free_queue.extend(to_tail)

    def cache_full_blocks(self, blocks: list[Block], block_hashes: list[int],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes."""
        null, cached = self.null_block, self.cached
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk is null:
                continue
            if blk.block_hash is not None:  # a partial entry promoted to a full block
                self._remove_hashes(blk)
            key = block_hashes[i]
            if key not in cached:  # the common case: a new key on a bare block
                blk.block_hash, blk.hash_tokens = key, (i + 1) * block_size
                cached[key] = blk
            else:
                self._insert_hash(key, blk, (i + 1) * block_size)

    def cache_partial_block(self, blk: Block, key: int, num_tokens: int,
                            replace_existing_hashes: bool = False) -> None:
        """Make ``blk`` reachable from a prefix boundary inside it (vLLM 0.32+'s partial entry).

        A shorter entry the block already carries is replaced; with
        ``replace_existing_hashes`` (the block's contents were overwritten) every entry is.
        """
        if blk is self.null_block:
            return
        already = self.has_entry(blk, key)
        if replace_existing_hashes or (
                not already and blk.block_hash is not None and blk.hash_tokens < num_tokens):
            self._remove_hashes(blk)
        self._insert_hash(key, blk, num_tokens)

    def has_entry(self, blk: Block, key: int) -> bool:
        """Whether ``blk`` is reachable under ``key`` (or is the null block)."""
        return blk is self.null_block or blk.block_hash == key or self._contains(key, blk)

    def evict(self, blk: Block) -> None:
        """Unpublish ``blk`` (vLLM's _maybe_evict_cached_block): its contents are gone."""
        if blk.block_hash is not None:
            self._remove_hashes(blk)

    def _contains(self, key: int, blk: Block) -> bool:
        entry = self.cached.get(key)
        return entry is blk or (isinstance(entry, dict) and blk.block_id in entry)

    def _insert_hash(self, key: int, blk: Block, num_tokens: int) -> None:
        entry = self.cached.get(key)
        if blk.block_hash == key or self._contains(key, blk):
            return
        if blk.block_hash is None:
            blk.block_hash, blk.hash_tokens = key, num_tokens
        else:
            self.extra_hashes.setdefault(blk.block_id, set()).add(key)
        if entry is None:
            self.cached[key] = blk
        elif isinstance(entry, Block):
            self.cached[key] = {entry.block_id: entry, blk.block_id: blk}
        else:
            entry[blk.block_id] = blk

    def _remove_hashes(self, blk: Block) -> None:
        """Drop every key the block is published under (eviction, or promotion)."""
        keys = [blk.block_hash, *self.extra_hashes.pop(blk.block_id, ())]
        for h in keys:
            entry = self.cached.get(h)
            if isinstance(entry, Block):
                if entry is blk:
                    del self.cached[h]
            elif entry is not None:
                entry.pop(blk.block_id, None)
                if len(entry) == 1:
                    self.cached[h] = next(iter(entry.values()))
                elif not entry:
                    del self.cached[h]
        blk.block_hash, blk.hash_tokens = None, 0

    # -- checks --------------------------------------------------------------------------

    def check_invariants(self, expected_ref_cnt: dict[int, int] | None = None) -> None:
        """Raise InvariantError unless the pool is consistent.

        Every non-null block is free xor referenced; ref counts are >= 0 (and equal
        ``expected_ref_cnt`` when given: how many block tables hold each block); the hash map
        and the blocks' hashes agree; free + used + null = total.
        """
        queued = list(self.free_queue)
        entries = self.free_queue.entries()
        queue = set(queued)
        if len(queue) != len(queued) or len(queued) != len(self.free_queue):
            raise InvariantError("the free queue holds a block twice or miscounts")
        if self.null_block.block_id in queue or self.null_block.block_hash is not None:
            raise InvariantError("null block is free or hashed")
        used = 0
        for blk in self.blocks[1:]:
            if blk.ref_cnt < 0:
                raise InvariantError(f"{blk} has a negative ref count")
            in_queue = blk.block_id in queue
            if entries[blk] != in_queue + blk.stale:
                raise InvariantError(f"{blk} queued={in_queue} but counts {blk.stale} stale entries")
            if in_queue == (blk.ref_cnt > 0):
                raise InvariantError(f"{blk} free={in_queue} but ref_cnt={blk.ref_cnt}")
            used += blk.ref_cnt > 0
            if expected_ref_cnt is not None and blk.ref_cnt != expected_ref_cnt.get(blk.block_id, 0):
                raise InvariantError(f"{blk} is held by {expected_ref_cnt.get(blk.block_id, 0)} "
                                     "block tables")
            if blk.block_hash is None and blk.block_id in self.extra_hashes:
                raise InvariantError(f"{blk} has extra keys but no primary hash")
            for h in ([blk.block_hash] if blk.block_hash is not None else []) + sorted(
                    self.extra_hashes.get(blk.block_id, ())):
                if not self._contains(h, blk):
                    raise InvariantError(f"{blk} is published under {h} but not in the hash map")
        for h, entry in self.cached.items():
            members = (entry,) if isinstance(entry, Block) else tuple(entry.values())
            if not members or (not isinstance(entry, Block) and len(members) < 2):
                raise InvariantError(f"hash {h} has a malformed entry {entry!r}")
            for m in members:
                if m.block_hash != h and h not in self.extra_hashes.get(m.block_id, ()):
                    raise InvariantError(f"hash map has {m} under {h}")
        if len(queue) + used + 1 != self.num_gpu_blocks:
            raise InvariantError(f"free {len(queue)} + used {used} + null != {self.num_gpu_blocks}")
        if not self.enable_caching and self.cached:
            raise InvariantError("hashes published with prefix caching off")
