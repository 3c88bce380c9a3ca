"""vLLM 0.33's native CPU offloading, scheduler side: ``OffloadingConnectorScheduler``
(``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``), ``CPUOffloadingManager``
(``v1/kv_offload/cpu/manager.py``) and its LRU policy (``cpu/policies/lru.py``).

The tier holds ``num_chunks`` chunks of ``blocks_per_chunk`` GPU blocks, keyed by the block
hash at each chunk's last block. Covered so far: one full-attention KV group, the LRU
or ARC policy, ``offload_prompt_only``, ``store_threshold``, EAGLE groups; a layout outside
that is refused where the connector is built.

- Lookups (``get_num_new_matched_tokens``) start at the chunk holding the local GPU hit,
  take whole consecutive chunks and are capped at the request's ``num_tokens`` (not
  ``num_tokens - 1``); a hit chunk whose store has not finished, or that another request is
  loading, defers the request. A request with transfers in flight is deferred too.
- Loads are asynchronous: the request holds its blocks until the worker reports the load.
- Stores are write-through: each step, the chunks a scheduled (or just finished) request
  fills are offered to the tier; chunks already there are only touched; a store that
  eviction cannot make room for is refused whole and offered again the next step.
- LRU: a request's chunks share one provisional rank (later positions evicted first) until
  it finishes, when its chunks' recency is committed tail first.
- A finished request's pending stores read blocks the GPU pool may hand out again: a step
  that re-allocates such a block flushes the store (the worker finishes it at once), as
  does preempting a request with stores in flight.

Pure Python, no SimPy; ``check_invariants`` checks the manager's counts.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from itertools import chain
from typing import Literal, Protocol

from kvsim.errors import ConfigError
from kvsim.kv.connector import ConnectorMeta, ConnectorOutput, StepView, TransferJob
from kvsim.kv.hashing import BlockHasher
from kvsim.model import GiB
from kvsim.request import KVTransferParams, Request, Status
from kvsim.semantics import VERSIONS, OffloadRules, Semantics


@dataclass(frozen=True, slots=True)
class OffloadParams:
    """vLLM's native CPU offloading, as ``--kv-offloading-size`` and the connector's extra
    config set it: the tier's size in chunks (kvsim sizes it from the GiB and the layout),
    ``blocks_per_chunk`` GPU blocks a chunk, ``offload_prompt_only``, ``store_threshold``
    (a chunk is stored once offered that many times; below 2, always)."""

    num_chunks: int
    blocks_per_chunk: int = 1
    offload_prompt_only: bool = True
    store_threshold: int = 0
    eviction_policy: Literal["lru", "arc"] = "lru"


# CPUOffloadingSpec rounds a chunk's bytes up to the page size (mmap.PAGESIZE on Linux).
PAGE_BYTES = 4096


def num_cpu_chunks(size_gib: float, block_bytes: int, world_size: int, blocks_per_chunk: int) -> int:
    """The chunks ``--kv-offloading-size`` buys (CPUOffloadingSpec): the GiB, summed over the
    workers, over one chunk on every worker (its GPU blocks' bytes on one worker times the
    world size) rounded up to the page."""
    chunk = -(-block_bytes * world_size * blocks_per_chunk // PAGE_BYTES) * PAGE_BYTES
    return int(size_gib * GiB) // chunk


def check_offload(where: str, offload: OffloadParams, sem: Semantics, spec_method: str,
                  hybrid: bool, enable_caching: bool) -> None:
    """Refuse, with a ConfigError at ``where``, what vLLM cannot run and what kvsim does not
    reproduce yet."""
    if sem.offload is None:
        covered = [v for v, s in VERSIONS.items() if s.offload is not None]
        raise ConfigError(where, f"native CPU offloading is reproduced for vLLM "
                          f"{', '.join(covered)}, not {sem.version}")
    if not enable_caching:
        # 0.33's connector keys chunks by the requests' block hashes, which exist only with
        # prefix caching: its first lookup fails an assertion.
        raise ConfigError(where, "native CPU offloading needs enable_prefix_caching (vLLM's "
                          "connector keys chunks by block hashes)")
    if hybrid:
        raise ConfigError(where, "offloading a hybrid KV layout is not reproduced yet "
                          "(one full-attention group is)")
    if spec_method == "draft_model":
        raise ConfigError(where, "offloading with a draft model is not reproduced yet (EAGLE, "
                          "EAGLE-3, MTP and ngram are)")
    if offload.num_chunks < 1:
        raise ConfigError(where, "holds no chunk: less CPU memory than one chunk of GPU blocks")


class Lookup(Enum):
    MISS = 0
    HIT = 1
    HIT_PENDING = 2


@dataclass(slots=True)
class _Chunk:
    chunk_id: int
    ref_cnt: int = -1  # -1: being written, not readable yet

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


@dataclass(slots=True)
class _Access:
    """One request's view of the tier (vLLM's ``ReqContext`` with the manager's and the
    policy's per-request state)."""

    positions: dict[int, int] = field(default_factory=dict)  # key -> end token
    rank: int | None = None
    seen: dict[int, None] = field(default_factory=dict)  # in the order first seen
    store_miss: set[int] = field(default_factory=set)
    inserted: set[int] = field(default_factory=set)  # chunks this request stored
    reused: set[int] = field(default_factory=set)  # ready chunks it loaded or found stored
    finished: bool = False

    def ordered(self) -> list[int]:
        """The chunks it saw, head to tail (by position, when every one has one)."""
        if all(k in self.positions for k in self.seen):
            return sorted(self.seen, key=self.positions.__getitem__)
        return list(self.seen)


class CachePolicy(Protocol):
    """What the manager asks of an eviction policy (vLLM's ``CachePolicy``)."""

    def get(self, key: int) -> _Chunk | None: ...

    def chunk_keys(self) -> Iterable[int]: ...

    def insert(self, key: int, chunk: _Chunk, acc: _Access) -> None: ...

    def on_store_miss(self, keys: list[int], acc: _Access) -> None: ...

    def on_request_access(self, keys: list[int], acc: _Access) -> None: ...

    def on_request_finished(self, acc: _Access) -> None: ...

    def evict(self, n: int, protected: set[int]) -> list[tuple[int, _Chunk]] | None: ...

    def mark_evictable(self, key: int) -> None: ...

    def mark_non_evictable(self, key: int) -> None: ...


class LRUPolicy:
    """``LRUCachePolicy``: ranks (request rank, -position) while a request runs, fresh ranks
    when it finishes (``request_ranks``; else every stored chunk a fresh rank, as 0.32);
    evictable chunks in a lazily invalidated heap."""

    def __init__(self, request_ranks: bool = True):
        self.request_ranks = request_ranks
        self.chunks: dict[int, _Chunk] = {}
        self.ranks: dict[int, tuple[int, int]] = {}
        self.evictable: set[int] = set()
        self.heap: list[tuple[tuple[int, int], int]] = []
        self.next_rank = 0

    def get(self, key: int) -> _Chunk | None:
        return self.chunks.get(key)

    def chunk_keys(self) -> Iterable[int]:
        return self.chunks.keys()

    def on_store_miss(self, keys: list[int], acc: _Access) -> None:
        self.update_recency(reversed(keys))  # the base policy's touch

    def request_rank(self, acc: _Access) -> int:
        if acc.rank is None:
            self.next_rank += 1
            acc.rank = self.next_rank
        return acc.rank

    def _push(self, key: int) -> None:
        heapq.heappush(self.heap, (self.ranks[key], key))

    def _compact(self) -> None:
        if len(self.heap) >= max(64, 2 * len(self.evictable)):
            self._rebuild()

    def _rebuild(self) -> None:
        self.heap = [(self.ranks[k], k) for k in self.evictable]
        heapq.heapify(self.heap)

    def _update_heap(self, keys: list[int]) -> None:
        if not keys:
            return
        if len(keys) >= max(64, len(self.evictable) // 4):
            self._rebuild()
        else:
            for k in keys:
                self._push(k)
            self._compact()

    def insert(self, key: int, chunk: _Chunk, acc: _Access) -> None:
        self.chunks[key] = chunk
        pos = acc.positions.get(key) if self.request_ranks else None
        if pos is None:
            self.next_rank += 1
            self.ranks[key] = (self.next_rank, 0)
        else:
            self.ranks[key] = (self.request_rank(acc), -pos)
        if chunk.ref_cnt == 0:
            self.evictable.add(key)
            self._push(key)

    def update_recency(self, keys) -> None:
        updated = []
        for key in keys:
            if key not in self.chunks:
                continue
            self.next_rank += 1
            self.ranks[key] = (self.next_rank, 0)
            if key in self.evictable:
                updated.append(key)
        self._update_heap(updated)

    def on_request_access(self, keys: list[int], acc: _Access) -> None:
        if not self.request_ranks:
            return
        rank = self.request_rank(acc)
        updated = []
        for key in keys:
            pos = acc.positions.get(key)
            if pos is None or key not in self.chunks:
                continue
            r = (rank, -pos)
            if self.ranks[key] >= r:
                continue
            self.ranks[key] = r
            if key in self.evictable:
                updated.append(key)
        self._update_heap(updated)

    def on_request_finished(self, acc: _Access) -> None:
        self.update_recency(reversed(acc.ordered()))

    def evict(self, n: int, protected: set[int]) -> list[tuple[int, _Chunk]] | None:
        if n == 0:
            return []
        selected: list[tuple[tuple[tuple[int, int], int], _Chunk]] = []
        keys: set[int] = set()
        deferred = []
        while self.heap and len(selected) < n:
            entry = heapq.heappop(self.heap)
            rank, key = entry
            if key not in self.evictable or self.ranks.get(key) != rank or key in keys:
                continue
            if key in protected:
                deferred.append(entry)
                continue
            selected.append((entry, self.chunks[key]))
            keys.add(key)
        if len(selected) < n:
            for entry, _ in selected:
                heapq.heappush(self.heap, entry)
            for entry in deferred:
                heapq.heappush(self.heap, entry)
            return None
        for entry in deferred:
            heapq.heappush(self.heap, entry)
        out = []
        for (_, key), chunk in selected:
            self.evictable.remove(key)
            del self.chunks[key]
            del self.ranks[key]
            out.append((key, chunk))
        self._compact()
        return out

    def mark_evictable(self, key: int) -> None:
        self.evictable.add(key)
        self._push(key)
        self._compact()

    def mark_non_evictable(self, key: int) -> None:
        self.evictable.remove(key)


class ARCPolicy:
    """``ARCCachePolicy``: T1 (chunks used once) and T2 (reused), ghost lists B1 and B2 of
    what each evicted, and the target size of T1 adapting to ghost hits."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.target_t1 = 0.0
        self.t1: OrderedDict[int, _Chunk] = OrderedDict()
        self.t2: OrderedDict[int, _Chunk] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def get(self, key: int) -> _Chunk | None:
        return self.t1.get(key) or self.t2.get(key)

    def chunk_keys(self) -> Iterable[int]:
        return chain(self.t1, self.t2)

    def insert(self, key: int, chunk: _Chunk, acc: _Access) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def _ghost_hit(self, key: int) -> None:
        if key in self.b1:
            self.target_t1 = min(self.target_t1 + max(1, len(self.b2) / len(self.b1)), self.capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target_t1 = max(self.target_t1 - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: list[int], acc: _Access) -> None:
        for key in reversed(keys):
            self._ghost_hit(key)

    def on_request_access(self, keys: list[int], acc: _Access) -> None:
        """(ARC commits a request's accesses when it finishes.)"""

    def on_request_finished(self, acc: _Access) -> None:
        insertion_only = acc.inserted - acc.reused
        for key in reversed(acc.ordered()):
            if key in insertion_only:
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in acc.reused and key in self.t1:
                self.t2[key] = self.t1.pop(key)
            elif key in acc.reused and key in self.t2:
                self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[int]) -> list[tuple[int, _Chunk]] | None:
        if n == 0:
            return []

        def next_candidate(entries):
            for key, chunk in entries:
                if chunk.ref_cnt == 0 and key not in protected:
                    return key, chunk
            return None
        picked: list[tuple[int, _Chunk, bool]] = []  # (key, chunk, from T1)
        virtual_t1 = len(self.t1)
        t1, t2 = iter(self.t1.items()), iter(self.t2.items())
        for _ in range(n):
            pick = None
            if virtual_t1 >= int(self.target_t1):
                entry = next_candidate(t1)
                if entry is not None:
                    pick, virtual_t1 = (*entry, True), virtual_t1 - 1
            if pick is None:
                entry = next_candidate(t2)
                if entry is not None:
                    pick = (*entry, False)
            if pick is None:
                entry = next_candidate(t1)
                if entry is None:
                    return None
                pick, virtual_t1 = (*entry, True), virtual_t1 - 1
            picked.append(pick)
        out = []
        for key, chunk, from_t1 in picked:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            out.append((key, chunk))
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return out

    def mark_evictable(self, key: int) -> None:
        """(ARC finds evictable chunks by their reference counts.)"""

    def mark_non_evictable(self, key: int) -> None:
        """(as above)"""


class CPUOffloadingManager:
    """``CPUOffloadingManager``: a pool of ``num_chunks`` slots, reference counts (-1 while a
    store is pending), the policy's eviction, ``store_threshold``'s offer counts."""

    def __init__(self, num_chunks: int, store_threshold: int = 0, max_tracker_size: int = 64_000,
                 eviction_policy: Literal["lru", "arc"] = "lru", request_ranks: bool = True):
        self.num_chunks = num_chunks
        self.num_allocated = 0
        self.free_list: list[int] = []
        self.policy: CachePolicy = (LRUPolicy(request_ranks) if eviction_policy == "lru"
                                    else ARCPolicy(num_chunks))
        self.num_evictable = 0
        self.num_write_pending = 0
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[int, int] | None = OrderedDict() if store_threshold >= 2 else None

    def lookup(self, key: int) -> Lookup:
        chunk = self.policy.get(key)
        if chunk is None:
            return Lookup.MISS
        return Lookup.HIT if chunk.is_ready else Lookup.HIT_PENDING

    def _num_free(self) -> int:
        return len(self.free_list) + self.num_chunks - self.num_allocated

    def _record_access(self, keys, acc: _Access, reused=()) -> None:
        new = []
        for key in keys:
            if key not in acc.seen:
                acc.seen[key] = None
                new.append(key)
        if new:
            self.policy.on_request_access(new, acc)
        acc.reused.update(k for k in reused if k not in acc.inserted)

    def _record_offers(self, keys: list[int]) -> None:
        counts = self.counts
        assert counts is not None
        protected = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                protected.add(key)
        unprotected = len(counts) - len(protected)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    def prepare_load(self, keys: list[int], acc: _Access) -> None:
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None and chunk.is_ready
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
                self.num_evictable -= 1
            chunk.ref_cnt += 1
        self._record_access(keys, acc, reused=keys)

    def complete_load(self, keys) -> None:
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.num_evictable += 1
                self.policy.mark_evictable(key)

    def prepare_store(self, keys: list[int], acc: _Access) -> list[int] | None:
        """The keys to write (absent ones), or None when eviction cannot make room."""
        if self.counts is not None:
            self._record_offers(keys)
        get = self.policy.get
        to_store = [k for k in keys if get(k) is None]
        ready = [k for k in keys if (c := get(k)) is not None and c.is_ready]
        if self.counts is not None:
            to_store = [k for k in to_store if self.counts.get(k, 0) >= self.store_threshold]
        misses = [k for k in to_store if k not in acc.store_miss]
        if misses:
            self.policy.on_store_miss(misses, acc)
            acc.store_miss.update(misses)
        recorded = {*to_store, *ready}
        self._record_access([k for k in keys if k in recorded], acc, reused=ready)
        if not to_store:
            return []
        evict = len(to_store) - self._num_free()
        if evict > 0:
            if evict > self.num_evictable:
                return None
            evicted = self.policy.evict(evict, set(keys))
            if evicted is None:
                return None
            self.num_evictable -= len(evicted)
            self.free_list.extend(chunk.chunk_id for _, chunk in evicted)
        for key in to_store:
            if self.num_allocated < self.num_chunks:
                chunk = _Chunk(self.num_allocated)
                self.num_allocated += 1
            else:
                chunk = _Chunk(self.free_list.pop())
            self.policy.insert(key, chunk, acc)
        self.num_write_pending += len(to_store)
        acc.inserted.update(to_store)
        return to_store

    def complete_store(self, keys) -> None:
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is not None and not chunk.is_ready:
                chunk.ref_cnt = 0
                self.num_write_pending -= 1
                self.num_evictable += 1
                self.policy.mark_evictable(key)

    def on_request_finished(self, acc: _Access) -> None:
        if acc.finished:
            return
        acc.finished = True
        self.policy.on_request_finished(acc)

    def check_invariants(self) -> None:
        chunks: dict[int, _Chunk] = {}
        for k in self.policy.chunk_keys():
            c = self.policy.get(k)
            assert c is not None
            chunks[k] = c
        assert len(chunks) == self.num_allocated - len(self.free_list)
        assert self.num_evictable == sum(1 for c in chunks.values() if c.ref_cnt == 0)
        assert self.num_write_pending == sum(1 for c in chunks.values() if c.ref_cnt < 0)
        if isinstance(self.policy, LRUPolicy):
            assert self.policy.evictable == {k for k, c in chunks.items() if c.ref_cnt == 0}
        assert len({c.chunk_id for c in chunks.values()} | set(self.free_list)) == self.num_allocated


@dataclass(slots=True)
class _ReqState:
    req: Request
    acc: _Access = field(default_factory=_Access)
    keys: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    next_stored: int = 0
    local_tokens: int = 0
    jobs: set[int] = field(default_factory=set)
    finished_signaled: bool = False


@dataclass(slots=True)
class _Job:
    req_id: str
    keys: list[int]
    is_store: bool
    fence: list[int] = field(default_factory=list)


class OffloadingConnector:
    """The scheduler side of ``OffloadingConnector`` for one full-attention group."""

    is_kv_consumer = True  # kv_role kv_both: it loads into the engine's blocks
    requires_kv_delivery = False  # a best-effort cache (vLLM opts out of the producer default)

    def __init__(self, hasher: BlockHasher, block_size: int, offload: OffloadParams,
                 rules: OffloadRules, eagle_group: bool = False):
        self.hasher = hasher
        self.block_size = block_size
        self.bpc = offload.blocks_per_chunk
        self.tokens_per_chunk = block_size * self.bpc
        self.offload_prompt_only = offload.offload_prompt_only
        # The group holds an EAGLE/MTP drafter's layers (with the block drop): the KV at a
        # decoding request's last position may be rewritten, so its trailing chunk is not
        # stored, and lookups query one chunk further and drop one.
        self.eagle_group = eagle_group
        self.manager = CPUOffloadingManager(offload.num_chunks, offload.store_threshold,
                                            eviction_policy=offload.eviction_policy,
                                            request_ranks=rules.lru_request_ranks)
        self.restore_from_start = rules.restore_from_start
        self.reqs: dict[str, _ReqState] = {}
        self.jobs: dict[int, _Job] = {}
        self.job_counter = 0
        self.batch_loads: list[TransferJob] = []
        self.batch_allocated: set[int] = set()
        self.batch_flush: set[int] = set()
        self.block_to_jobs: dict[int, set[int]] = {}
        self.being_loaded: set[int] = set()  # chunks loads in flight read

    # -- keys -----------------------------------------------------------------------------

    def _update_keys(self, st: _ReqState) -> None:
        req = st.req
        hashes = self.hasher.block_hashes(req, req.num_tokens // self.block_size)
        bpc = self.bpc
        for i in range(bpc * len(st.keys) + bpc - 1, len(hashes), bpc):
            key = hashes[i]
            st.keys.append(key)
            st.acc.positions[key] = len(st.keys) * self.tokens_per_chunk

    # -- KVConnector ------------------------------------------------------------------------

    def on_new_request(self, req: Request) -> None:
        self.reqs[req.req_id] = _ReqState(req)

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        st = self.reqs[req.req_id]
        st.block_ids.clear()
        if self.restore_from_start:
            st.next_stored = 0
        if st.jobs:
            return None, False
        self._update_keys(st)
        st.local_tokens = num_computed_tokens
        hit = self._lookup(st)
        return hit, bool(hit)

    def _lookup(self, st: _ReqState) -> int | None:
        tpc = self.tokens_per_chunk
        local = st.local_tokens
        max_hit = min(st.req.num_tokens, len(st.keys) * tpc)
        if max_hit - local < tpc:
            return 0
        query_max = min(max_hit + tpc, len(st.keys) * tpc) if self.eagle_group else max_hit
        num_chunks = min(-(-query_max // tpc), len(st.keys))
        start = local // tpc
        hits, pending = 0, False
        for key in st.keys[start:num_chunks]:
            result = self.manager.lookup(key)
            if result is Lookup.MISS:
                break
            hits += 1
            pending |= result is Lookup.HIT_PENDING
        if hits == 0:
            return 0
        if pending:
            return None
        if self.eagle_group:
            hits -= 1  # the drafter's KV of a hit's last chunk is recomputed
        max_hit = min(max_hit, tpc * (start + hits))
        num_hit = max_hit - local
        if num_hit < tpc:
            return 0
        if self.being_loaded:
            end = -(-(local + num_hit) // tpc)
            if any(k in self.being_loaded for k in st.keys[start:end]):
                return None
        return num_hit

    def update_state_after_alloc(self, req: Request, block_ids: list[int], block_hashed: list[bool],
                                 num_external_tokens: int) -> None:
        self.batch_allocated.update(b for b in block_ids if b != 0)
        if num_external_tokens == 0:
            return
        st = self.reqs[req.req_id]
        b = self.block_size
        cached = st.local_tokens + num_external_tokens
        num_gpu_blocks = -(-cached // b)
        first_fresh = -(-st.local_tokens // b)
        start_block = next((i for i in range(first_fresh, num_gpu_blocks) if not block_hashed[i]),
                           num_gpu_blocks)
        num_chunks = -(-cached // self.tokens_per_chunk)
        keys = st.keys[start_block // self.bpc:num_chunks] if num_gpu_blocks > start_block else []
        st.next_stored = num_chunks
        self.manager.prepare_load(keys, st.acc)
        job_id = self._new_job()
        self.batch_loads.append(TransferJob(job_id, req.req_id, "load", num_gpu_blocks - start_block))
        st.jobs.add(job_id)
        self.jobs[job_id] = _Job(req.req_id, keys, False)
        self.being_loaded.update(keys)

    def _new_job(self) -> int:
        self.job_counter += 1
        return self.job_counter - 1

    def request_finished(self, req: Request) -> tuple[bool, KVTransferParams | None]:
        st = self.reqs.get(req.req_id)
        if st is None:
            return False, None
        self._update_keys(st)
        for job_id in st.jobs:
            for bid in self.jobs[job_id].fence:
                self.block_to_jobs.setdefault(bid, set()).add(job_id)
        return False, None

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        for req_id, (ids, full) in step.new_block_ids.items():
            st = self.reqs[req_id]
            self._update_keys(st)
            if full:
                st.block_ids.clear()
            st.block_ids.extend(ids)
            self.batch_allocated.update(b for b in ids if b != 0)
        for req_id in step.preempted:
            victim = self.reqs.get(req_id)
            if victim is not None and victim.jobs:
                self.batch_flush.update(victim.jobs)
        if self.block_to_jobs and not self.block_to_jobs.keys().isdisjoint(self.batch_allocated):
            self.batch_flush.update(j for b in self.batch_allocated if b in self.block_to_jobs
                                    for j in self.block_to_jobs[b])
        stores = self._build_store_jobs(step)
        meta = ConnectorMeta(tuple(self.batch_loads), tuple(stores), frozenset(self.batch_flush))
        for req in step.finished:
            done = self.reqs.get(req.req_id)
            if done is None:
                continue
            done.finished_signaled = True
            self.manager.on_request_finished(done.acc)
            if not done.jobs:
                del self.reqs[req.req_id]
        self.batch_loads = []
        self.batch_flush = set()
        self.batch_allocated = set()
        return meta

    def _storable(self, st: _ReqState, num_tokens: int) -> int:
        num_chunks = num_tokens // self.tokens_per_chunk
        if (self.eagle_group and num_tokens > st.req.num_prompt_tokens
                and st.req.status is not Status.FINISHED):
            num_chunks = max(0, num_chunks - 1)  # decoding: the trailing chunk is volatile
        return min(num_chunks, len(st.block_ids) // self.bpc, len(st.keys))

    def _build_store_jobs(self, step: StepView) -> list[TransferJob]:
        jobs = []
        finished = {r.req_id: r for r in step.finished}
        for req_id in chain(step.num_scheduled_tokens, finished):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            req = st.req
            if req_id in finished:
                after = max(req.num_prompt_tokens, req.num_tokens - 1)
            else:
                after = req.num_computed_tokens + step.num_scheduled_tokens[req_id]
            offloadable = min(after, req.num_tokens)
            if self.offload_prompt_only:
                offloadable = min(offloadable, req.num_prompt_tokens)
            num_chunks = self._storable(st, offloadable)
            start = st.next_stored
            new_keys = []
            for i in range(start, num_chunks):
                if 0 not in st.block_ids[i * self.bpc:(i + 1) * self.bpc]:  # (0: a null block)
                    new_keys.append(st.keys[i])
            if not new_keys:
                st.next_stored = max(st.next_stored, num_chunks)
                continue
            to_store = self.manager.prepare_store(new_keys, st.acc)
            if to_store is None:
                continue  # dropped (vllm:kv_offload_allocation_failure); offered again next step
            if not to_store:
                st.next_stored = max(st.next_stored, num_chunks)
                continue
            store_set = set(to_store)
            fence: list[int] = []
            for i in range(start, num_chunks):
                if st.keys[i] in store_set:
                    fence.extend(b for b in st.block_ids[i * self.bpc:(i + 1) * self.bpc] if b != 0)
            st.next_stored = max(st.next_stored, num_chunks)
            job_id = self._new_job()
            st.jobs.add(job_id)
            self.jobs[job_id] = _Job(req_id, to_store, True, fence)
            jobs.append(TransferJob(job_id, req_id, "store", len(fence)))
            if req.status is Status.FINISHED:
                for bid in fence:
                    self.block_to_jobs.setdefault(bid, set()).add(job_id)
                    if bid in self.batch_allocated:
                        self.batch_flush.add(job_id)
        return jobs

    def update_connector_output(self, output: ConnectorOutput) -> None:
        for job_id in output.completed_jobs:
            job = self.jobs.pop(job_id)
            st = self.reqs[job.req_id]
            if job.is_store:
                self.manager.complete_store(job.keys)
            else:
                self.manager.complete_load(job.keys)
                self.being_loaded.difference_update(job.keys)
            if self.block_to_jobs and job.is_store and st.req.status is Status.FINISHED:
                for bid in job.fence:
                    pending = self.block_to_jobs.get(bid)
                    if pending is not None:
                        pending.discard(job_id)
                        if not pending:
                            del self.block_to_jobs[bid]
            st.jobs.discard(job_id)
            if st.finished_signaled and not st.jobs:
                del self.reqs[job.req_id]

    def has_pending_work(self) -> bool:
        return bool(self.jobs)

    def held_keys(self) -> list[int]:
        """The block hashes the tier and the requests it tracks hold (kept when the hasher
        forgets unused ones)."""
        return [*self.manager.policy.chunk_keys(), *(k for st in self.reqs.values() for k in st.keys)]

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        for job_id, job in self.jobs.items():
            assert job_id in self.reqs[job.req_id].jobs
