import pytest

from llmserve.core.block_pool import BlockPool


def test_allocate_takes_from_front_and_free_returns_tail_first():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free == 1
    pool.free([0, 1, 2])  # freed tail first: 2, 1, 0 join the back of the queue
    assert pool.allocate(4) == [5, 2, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 1]


def test_allocate_fails_without_change_when_too_few_free():
    pool = BlockPool(2)
    assert pool.allocate(3) is None
    assert pool.num_free == 2


def test_cached_block_is_reused_by_touch_and_evicted_by_allocate():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.cache(a[0], 111)
    pool.free(a)
    assert pool.lookup(111) == 0
    pool.touch([0])  # a prefix hit takes the free cached block back
    assert pool.blocks[0].ref_cnt == 1 and pool.num_free == 2
    pool.free([0])
    assert pool.allocate(3) == [2, 1, 0]  # LRU order; block 0 is evicted last
    assert pool.lookup(111) is None and pool.blocks[0].block_hash is None


def test_shared_block_ref_counts():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.touch([b])
    pool.touch([b])
    assert pool.blocks[b].ref_cnt == 3
    pool.free([b])
    pool.free([b])
    assert pool.num_free == 3
    pool.free([b])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 7)
    pool.cache(b, 7)
    assert pool.lookup(7) == a
    pool.free([a])
    pool.allocate(1)  # evicts a; b still carries the hash but is not indexed
    assert pool.lookup(7) is None
