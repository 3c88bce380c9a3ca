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

Ids come in chains: the blocks of one call that follow a new key are new too (an id just made
is nobody's parent yet), so they get consecutive ids, and only the first key is interned; the
rest is the chain's list of contents (a ``range`` for a prompt's run of consecutive ids: a
100k-token prompt costs a few integers, not a key per block). The child of an id inside a
chain is the next id when its content is the chain's next; any other child is an interned key.

Past the prompt no key is interned: a request's output tokens all carry its
``output_token_id`` (negative; prompt ids are not), so the first block that reaches an output
token (its id h0 interned as above) fixes the prompt, where it ends and which token follows,
and every later block of the request is the j-th block after it. Its id is derived from
(h0, j) (``_derived``: below -2^63, apart from interned ids and from a hybrid layout's
negative coarse ids), with no lookup: equal exactly when the whole prefixes are.
"""

from __future__ import annotations

from bisect import bisect_right

from kvsim.request import Request

_DERIVED = -(1 << 63)  # ids of blocks after a request's first output block: _DERIVED - (h0 << 32) - j
_J = 32  # bits of j (blocks after the first output block; a request has far fewer than 2^32)


def _derived(h0: int, j: int) -> int:
    return _DERIVED - (h0 << _J) - j


def _derived_from(h: int) -> tuple[int, int]:
    """(h0, j) of a derived id ``h``."""
    return divmod(_DERIVED - h, 1 << _J)


class BlockHasher:
    """Interns chained block keys to ints; one per simulated engine."""

    __slots__ = ("block_size", "lookahead", "_ids", "_starts", "_chains", "_next", "_size")

    def __init__(self, block_size: int, lookahead: int = 0):
        self.block_size = block_size
        self.lookahead = lookahead
        self._ids: dict[tuple, int] = {}  # (parent id, content) -> id: the first of each chain
        self._starts: list[int] = []  # the first ids of the chains of two or more, ascending
        self._chains: list = []  # their contents, in order (a range or a list)
        self._next = 0
        self._size = 0  # what memory grows with: keys and their tuples' items, chains, listed contents

    def __len__(self) -> int:
        """What the hasher's memory grows with (the engine drops unused keys past a bound)."""
        return self._size

    def _chain_of(self, h: int) -> int:
        """The index of the chain that holds id ``h`` (-1: none does)."""
        i = bisect_right(self._starts, h) - 1
        return i if i >= 0 and h - self._starts[i] < len(self._chains[i]) else -1

    def contents(self, derived=()) -> dict[int, tuple]:
        """For checks: each id held, and each derived id of ``derived``, as what it stands
        for, whatever order the ids were made in: the contents of its blocks from the first
        (a derived id: its first output block's, then ``("+", j)``)."""
        parent = {h: key for key, h in self._ids.items()}
        for a, chain in zip(self._starts, self._chains):
            for t in range(1, len(chain)):
                parent[a + t] = (a + t - 1, chain[t])
        out: dict[int, tuple] = {}
        for h in sorted(parent):  # (a parent's id is smaller than its children's)
            p, c = parent[h]
            out[h] = (c,) if p is None else (*out[p], c)
        for h in derived:
            if h < 0:
                h0, j = _derived_from(h)
                out[h] = (*out[h0], ("+", j))
        return out

    def forget_all_but(self, live) -> None:
        """Drop the keys no one can compare against any more, to bound memory.

        ``live`` holds every id still held somewhere (published in the pool, in a live
        request's ``block_hashes``). Their keys stay, and so do their ancestors' keys (a
        chain computed again must reach the same ids), a chain whole. A dropped key computed
        again gets a fresh id; as nothing holds its old id, and nothing kept descends from
        it, every later lookup and publication compares exactly as it would have.
        """
        parent = {h: key[0] for key, h in self._ids.items()}
        starts, chains = self._starts, self._chains
        keep: set[int] = set()  # ids of kept keys (a chain's: its first)
        for h in live:
            if h < 0:
                h = _derived_from(h)[0]
            while h is not None:
                if h not in parent:  # inside a chain (or dropped already)
                    i = self._chain_of(h)
                    if i < 0:
                        break
                    h = starts[i]
                if h in keep:
                    break
                keep.add(h)
                h = parent[h]
        self._ids = {key: h for key, h in self._ids.items() if h in keep}
        kept = [i for i, a in enumerate(starts) if a in keep]
        self._starts = [starts[i] for i in kept]
        self._chains = [chains[i] for i in kept]
        self._size = sum(_cost(key[1]) for key in self._ids) + sum(map(_cost, self._chains))

    def block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Extend ``req.block_hashes`` to ``num_blocks`` full blocks (if that many exist).

        Mutates ``req.block_hashes``; returns it.
        """
        hashes = req.block_hashes
        b = self.block_size
        done = len(hashes)
        limit = min(num_blocks, (req.num_tokens - self.lookahead) // b)
        first_out = max((req.num_prompt_tokens - self.lookahead) // b, 0)  # reaches an output
        if done < limit and done <= first_out:
            self._intern(req, hashes, done, min(limit, first_out + 1))
            done = len(hashes)
        if done < limit:  # (a list, not a range: ints past 2^63 make a slow range)
            base = _derived(hashes[first_out], 0)
            hashes.extend([base - j for j in range(done - first_out, limit - first_out)])
        return hashes

    def _intern(self, req: Request, hashes: list[int], done: int, limit: int) -> None:
        """Append the ids of blocks ``done`` to ``limit`` (> done), found by their keys."""
        b = self.block_size
        contents = req.block_contents(done * b, limit - done, b, b + self.lookahead)
        parent = hashes[-1] if done else None
        ids, starts, chains = self._ids, self._starts, self._chains
        k, n = 0, len(contents)
        while k < n:
            if parent is not None and (i := self._chain_of(parent)) >= 0:
                j = parent + 1 - starts[i]  # parent's chained child, if it has one
                if j < len(chains[i]) and (m := _common_prefix(chains[i], j, contents, k)):
                    hashes.extend(range(parent + 1, parent + 1 + m))  # down the chain
                    parent += m
                    k += m
                    continue
            h = ids.get((parent, contents[k]))
            if h is None:
                break
            hashes.append(h)
            parent = h
            k += 1
        else:
            return
        # A new key: it and the rest are new, consecutive ids.
        a = self._next
        ids[(parent, contents[k])] = a
        self._size += _cost(contents[k])
        self._next = a + n - k
        hashes.extend(range(a, self._next))
        if n - k > 1:  # a chain (one id alone has no chained child)
            rest = contents[k:]
            starts.append(a)
            chains.append(rest)
            self._size += _cost(rest)


def _cost(held) -> int:
    """What a key's content or a chain's contents adds to ``len(BlockHasher)``: one, and one
    per item of a tuple or list (a range is one object whatever its length)."""
    return 1 + len(held) if type(held) in (tuple, list) else 1


def _common_prefix(chain, j: int, contents, k: int) -> int:
    """How many of ``contents[k:]`` equal ``chain[j:]``, item by item, from the first."""
    m = min(len(chain) - j, len(contents) - k)
    if chain[j:j + m] == contents[k:k + m]:  # (two ranges compare in O(1))
        return m
    for t in range(m):
        if chain[j + t] != contents[k + t]:
            return t
    return m
