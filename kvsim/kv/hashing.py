"""Chained full-block hashes, as vLLM's ``hash_block_tokens`` chains them.

vLLM hashes ``(parent_hash, tuple(block_tokens), extra_keys)`` with sha256; kvsim needs only
equality, so it interns the same triple to a small integer. Two blocks get the same id
exactly when their whole prefixes are equal, with no collisions. Only full blocks are hashed;
a partial tail never is.
"""

from __future__ import annotations

from kvsim.request import Request


class BlockHasher:
    """Interns chained block keys to ints; one per simulated engine."""

    __slots__ = ("block_size", "_ids")

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._ids: dict[tuple, int] = {}

    def block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Extend ``req.block_hashes`` to ``num_blocks`` full blocks (if that many exist).

        Mutates ``req.block_hashes``; returns it.
        """
        hashes = req.block_hashes
        b = self.block_size
        limit = min(num_blocks, req.num_tokens // b)
        ids = self._ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), limit):
            key = (parent, req.token_window(i * b, (i + 1) * b))
            h = ids.get(key)
            if h is None:
                h = len(ids)
                ids[key] = h
            hashes.append(h)
            parent = h
        return hashes
