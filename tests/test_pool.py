"""Block pool and manager rules, with block ids derived by hand from vLLM 0.33.0's
block_pool.py / single_type_kv_cache_manager.py (see the comments for each derivation)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.errors import InvariantError
from kvsim.kv.pool import Block, BlockPool, FreeQueue
from tests.builders import make_manager, make_request


def test_null_block_is_reserved_and_usage_excludes_it():
    pool = BlockPool(5, True, True)
    assert list(pool.free_queue) == [1, 2, 3, 4]
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert pool.usage() == pytest.approx(1 - 2 / 4)
    pool.check_invariants()


def test_free_puts_unhashed_blocks_in_front_and_hashed_ones_at_the_tail_033():
    # b = 4. A has 10 tokens: blocks [1,2,3]; 1 and 2 are full and hashed, 3 is a partial tail.
    # free() walks [3,2,1]: 3 (unhashed) is prepended, 2 then 1 are appended.
    kv = make_manager(10, 4)
    a = make_request("A", range(10))
    assert [b.block_id for b in kv.allocate_slots(a, 10)] == [1, 2, 3]
    kv.free(a)
    assert list(kv.pool.free_queue) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    kv.check_invariants()
    # B shares A's first 8 tokens: hits blocks 1, 2 (touch takes them out of the queue without
    # reordering the rest) and pops block 3 from the head for its tail.
    b = make_request("B", [*range(8), 100, 101, 102])
    hit_blocks, hit = kv.get_computed_blocks(b)
    assert ([blk.block_id for blk in hit_blocks], hit) == ([1, 2], 8)
    # 3 slots needed: 1 new block + 2 evictable hit blocks leave the free queue.
    assert kv.num_blocks_to_allocate("B", 11, hit_blocks) == 3
    kv.allocate_slots(b, 3, hit, hit_blocks)
    assert kv.block_ids("B") == [1, 2, 3]
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 8, 9]
    kv.check_invariants()


def test_lazy_eviction_when_a_cached_free_block_is_reused():
    # b = 4, 5 usable blocks. A (8 tokens) caches [1,2]; freed -> queue [3,4,5,2,1].
    kv = make_manager(6, 4)
    a = make_request("A", range(8))
    kv.allocate_slots(a, 8)
    kv.free(a)
    assert list(kv.pool.free_queue) == [3, 4, 5, 2, 1]
    # C needs 4 blocks: pops 3,4,5,2 -> block 2 loses A's second-block hash.
    c = make_request("C", range(50, 66))
    kv.allocate_slots(c, 16)
    assert kv.block_ids("C") == [3, 4, 5, 2]
    kv.check_invariants()
    # A again (+1 token): block 0 of A still cached in block 1, block 1 evicted -> hit 4.
    a2 = make_request("A2", range(9))
    blocks, hit = kv.get_computed_blocks(a2)
    assert ([b.block_id for b in blocks], hit) == ([1], 4)


def test_caching_off_frees_everything_to_the_front_and_never_hits():
    kv = make_manager(6, 4, enable_caching=False)
    a = make_request("A", range(8))
    kv.allocate_slots(a, 8)
    kv.free(a)
    assert list(kv.pool.free_queue) == [2, 1, 3, 4, 5]
    assert kv.get_computed_blocks(make_request("A2", range(9))) == ([], 0)
    assert not kv.pool.cached


def test_hashes_publish_at_schedule_time_up_to_num_tokens_only():
    # A chunk of 6 tokens of a 10-token prompt (b = 4) caches one full block now.
    kv = make_manager(10, 4)
    a = make_request("A", range(10))
    kv.allocate_slots(a, 6)
    assert kv.num_cached_block["A"] == 1
    a.num_computed_tokens = 6
    kv.allocate_slots(a, 4)
    assert kv.num_cached_block["A"] == 2  # 10 tokens: two full blocks, the tail never
    kv.check_invariants()


def test_duplicate_content_is_not_deduplicated_and_lookup_returns_the_oldest():
    kv = make_manager(10, 4)
    a, b = make_request("A", range(4)), make_request("B", range(4))
    kv.allocate_slots(a, 4)
    kv.allocate_slots(b, 4)  # no lookup: B computes the same block again
    assert kv.block_ids("A") == [1] and kv.block_ids("B") == [2]
    probe = make_request("P", range(5))
    assert [blk.block_id for blk in kv.get_computed_blocks(probe)[0]] == [1]
    kv.free(a)
    kv.pool.get_new_blocks(8)  # evicts block 1 and everything else free
    assert [blk.block_id for blk in kv.get_computed_blocks(probe)[0]] == [2]
    kv.pool.check_invariants()  # blocks taken straight from the pool belong to no table


def test_admission_gate_counts_the_whole_prompt():
    # 5 usable blocks, b = 4: a 24-token prompt (6 blocks) never fits, even chunked to 4 tokens.
    kv = make_manager(6, 4)
    r = make_request("R", range(24))
    assert kv.allocate_slots(r, 4, full_sequence_must_fit=True) is None
    assert kv.allocate_slots(r, 4) is not None  # without the gate the first chunk fits


def test_check_invariants_catches_corruption():
    pool = BlockPool(5, True, True)
    blk = pool.get_new_blocks(1)[0]
    blk.ref_cnt = 0  # referenced-looking block outside the free queue with ref 0
    with pytest.raises(InvariantError):
        pool.check_invariants()
    blk.ref_cnt = 1
    pool.check_invariants()
    with pytest.raises(InvariantError):
        pool.check_invariants({blk.block_id: 2})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["tail", "front", "remove", "take"]),
                          st.integers(0, 2000)), max_size=400))
def test_free_queue_keeps_the_order_of_a_linked_list(ops):
    """FreeQueue (a deque with stale entries for blocks taken out of the middle, compacted when
    they pile up) against a plain ordered model of vLLM's doubly linked free list."""
    blocks = [Block(i) for i in range(1, 41)]
    queue = FreeQueue(blocks[:25], slack=3)  # compacts often
    model = list(range(1, 26))
    for op, i in ops:
        blk = blocks[i % 40]
        queued = blk.block_id in model
        if op in ("tail", "front") and not queued:
            queue.extend([blk]) if op == "tail" else queue.extend_front([blk])
            model.insert(len(model) if op == "tail" else 0, blk.block_id)
        elif op == "remove" and queued:
            queue.remove(blk)
            model.remove(blk.block_id)
        elif op == "take" and model:
            n = i % 4 + 1 if len(model) > 4 else len(model)
            assert [b.block_id for b in queue.take(n)] == model[:n]
            del model[:n]
        assert len(queue) == len(model)
    assert list(queue) == model
    entries = queue.entries()
    for b in blocks:  # each block's stale entries counted
        assert entries[b] == b.stale + (b.block_id in model)


def test_free_queue_compaction_keeps_the_queued_blocks_in_order():
    blocks = [Block(i) for i in range(1, 11)]
    queue = FreeQueue(blocks, slack=1)
    for i in (1, 2, 4, 5, 7, 8):  # prefix hits take blocks 2, 3, 5, 6, 8, 9 out
        queue.remove(blocks[i])
    assert len(queue._q) < 10, "the stale entries were dropped"
    queue.extend_front([blocks[4]])
    queue.extend([blocks[1]])
    assert list(queue) == [5, 1, 4, 7, 10, 2]
    assert [b.block_id for b in queue.take(3)] == [5, 1, 4]
    assert list(queue) == [7, 10, 2] and len(queue) == 3
