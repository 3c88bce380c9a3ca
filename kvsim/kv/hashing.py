"""Chained full-block hashes, as vLLM's ``hash_block_tokens`` chains them.

vLLM hashes ``(parent_hash, tuple(block_tokens), extra_keys)`` with sha256; kvsim needs only
equality, so it interns ``(parent id, block content)`` to a small integer, the content in a
canonical form (``request.block_content``: a run of consecutive ids is its first id). Two
blocks get the same id exactly when their whole prefixes are equal, with no collisions. Only
full blocks are hashed; a partial tail never is.

With ``lookahead`` L > 0 (vLLM 0.33's lookahead block hashes for EAGLE-family drafters) the
key of block i also holds the L tokens after it, so the block becomes hashable only once
``num_tokens >= (i + 1) * block_size + L``: a block is reused only if what follows it matches
too, which is what the drafter's KV at the block's last position depends on.
"""

from __future__ import annotations

from kvsim.request import Request


class BlockHasher:
    """Interns chained block keys to ints; one per simulated engine."""

    __slots__ = ("block_size", "lookahead", "_ids", "_next")

    def __init__(self, block_size: int, lookahead: int = 0):
        self.block_size = block_size
        self.lookahead = lookahead
        self._ids: dict[tuple, int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._ids)

    def forget_all_but(self, live) -> None:
        """Drop the keys no one can compare against any more, to bound memory.

        ``live`` holds every id still held somewhere (published in the pool, in a live
        request's ``block_hashes``). Their keys stay, and so do their ancestors' keys (a
        chain computed again must reach the same ids). A dropped key computed again gets a
        fresh id; as nothing holds its old id, and nothing kept descends from it, every
        later lookup and publication compares exactly as it would have.
        """
        parent = {h: key[0] for key, h in self._ids.items()}
        keep: set[int] = set()
        for h in live:
            while h is not None and h not in keep and h in parent:
                keep.add(h)
                h = parent[h]
        self._ids = {key: h for key, h in self._ids.items() if h in keep}

    def block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Extend ``req.block_hashes`` to ``num_blocks`` full blocks (if that many exist).

        Mutates ``req.block_hashes``; returns it.
        """
        hashes = req.block_hashes
        b = self.block_size
        la = self.lookahead
        limit = min(num_blocks, (req.num_tokens - la) // b)
        ids = self._ids
        parent = hashes[-1] if hashes else None
        first = len(hashes) * b
        if first >= limit * b:
            return hashes
        next_id = self._next
        for content in req.block_contents(first, limit - len(hashes), b, b + la):
            h = ids.setdefault((parent, content), next_id)
            if h == next_id:
                next_id += 1
            hashes.append(h)
            parent = h
        self._next = next_id
        return hashes
