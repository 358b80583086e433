"""Paged KV cache: block accounting (allocate, extend, rollback, free; under random operations too) and the batch
view's slots and pools against the contiguous cache."""
import random

import pytest
import torch

from selfspec.cache import KVCache
from selfspec.cache.paged import TRASH, PagedKVCache, gather_blocks
from selfspec.errors import SelfspecError
from selfspec.kernels import rope_and_store

L, HKV, D, BS = 2, 2, 4, 4


def make(num_blocks=8):
    return PagedKVCache(L, num_blocks, HKV, BS, D, torch.float32)


def store(cache, layer, pos, k, v):
    """Store k, v [B, Hkv, T, D] at positions pos [B, T] as the model does; return the layer's pools and table."""
    kv = cache.layer(layer)
    k_pool, v_pool, table = kv.k, kv.v, kv.table
    cos, sin = torch.ones(*pos.shape, D), torch.zeros(*pos.shape, D)  # angle 0: RoPE is the identity
    rope_and_store(k, k, v, cos, sin, k_pool, v_pool, cache.slots(pos))
    return k_pool, v_pool, table


def test_block_accounting_and_rollback():
    c = make(8)
    c.allocate("a", 5)  # 2 blocks
    c.allocate("b")
    assert c.blocks_used == 2 and c.tables["b"] == []
    c.extend("b", 9)  # 3 blocks
    assert c.blocks_used == 5 and TRASH not in c.tables["a"] + c.tables["b"]
    c.truncate("b", 4)  # rollback to one full block frees the other two
    assert c.blocks_used == 3 and c.lengths["b"] == 4
    c.extend("b", 1)  # position 4 starts a new block
    assert len(c.tables["b"]) == 2
    c.truncate("b", 5)
    assert len(c.tables["b"]) == 2 and c.lengths["b"] == 5
    with pytest.raises(SelfspecError, match="out of blocks"):
        c.extend("a", 40)
    assert c.blocks_used == 4  # a failed extend allocates nothing
    c.free("a")
    c.free("a")  # idempotent
    c.free("b")
    assert c.blocks_used == 0 and sorted(c.free_blocks) == list(range(1, 9))


def assert_partition(c):
    """Every block is either free or in exactly one table, and each table covers its sequence's length."""
    owned = [b for table in c.tables.values() for b in table]
    assert sorted(owned + c.free_blocks) == list(range(1, c.num_blocks + 1))
    assert all(len(c.tables[s]) >= c.blocks_for(n) for s, n in c.lengths.items())


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_each_block_with_one_owner(seed):
    """blocks_needed predicts what extend takes; a refused extend takes nothing; the pool ends empty."""
    rng = random.Random(seed)
    c = make(12)
    for _ in range(300):
        seq = str(rng.randrange(6))
        op = rng.choice(["extend", "truncate", "free"])
        if seq not in c.tables:
            c.allocate(seq)
        elif op == "extend":
            n, free = rng.randrange(0, 12), len(c.free_blocks)
            need = c.blocks_needed(seq, n)
            if need > free:
                with pytest.raises(SelfspecError, match="out of blocks"):
                    c.extend(seq, n)
                assert len(c.free_blocks) == free
            else:
                c.extend(seq, n)
                assert free - len(c.free_blocks) == need and c.blocks_needed(seq, n) == 0
                c.truncate(seq, c.lengths[seq] + rng.randrange(0, n + 1))  # commit part of what was written
        elif op == "truncate":
            c.truncate(seq, rng.randrange(0, c.lengths[seq] + 1))
        else:
            c.free(seq)
        assert_partition(c)
    for seq in list(c.tables):
        c.free(seq)
    assert c.blocks_used == 0 and not c.tables


@torch.inference_mode()
def test_view_matches_contiguous_cache():
    """Two sequences of different lengths written through one view read back the same keys as a
    contiguous cache at every position they own."""
    torch.manual_seed(0)
    c = make(16)
    lens = [3, 9]
    for i, n in enumerate(lens):
        c.allocate(str(i), n + 2)
    ref = KVCache(L, 2, HKV, 16, D, torch.float32)
    pos = torch.tensor([[3, 4], [9, 10]])
    for layer in range(L):
        # History first (prefill), then a T=2 pass at each row's own positions.
        for i, n in enumerate(lens):
            k, v = torch.randn(1, HKV, n, D), torch.randn(1, HKV, n, D)
            store(c.view([str(i)]), layer, torch.arange(n)[None], k, v)
            ref.k[layer, i, :, :n], ref.v[layer, i, :, :n] = k[0], v[0]
        k, v = torch.randn(2, HKV, 2, D), torch.randn(2, HKV, 2, D)
        k_pool, v_pool, table = store(c.view(["0", "1"]), layer, pos, k, v)
        keys, values = gather_blocks(k_pool, table), gather_blocks(v_pool, table)
        rk, rv, _ = store(ref, layer, pos, k, v)
        assert keys.shape == (2, HKV, 12, D)  # the longest table: 3 blocks of 4
        for i, n in enumerate(lens):
            torch.testing.assert_close(keys[i, :, : n + 2], rk[i, :, : n + 2], rtol=0, atol=0)
            torch.testing.assert_close(values[i, :, : n + 2], rv[i, :, : n + 2], rtol=0, atol=0)


def test_contiguous_cache_slots_are_one_block_per_row():
    ref = KVCache(L, 2, HKV, 16, D, torch.float32)
    n_slots = ref.k.shape[3]  # 64: max_len rounded up to whole attention tiles
    assert ref.slots(torch.tensor([[3, 4], [9, 10]])).tolist() == [[3, 4], [n_slots + 9, n_slots + 10]]


def test_view_slots_follow_the_block_tables():
    c = make(8)
    c.allocate("a", 6)
    c.allocate("b", 2)
    view = c.view(["a", "b"])
    a, b = c.tables["a"], c.tables["b"]  # position p: slot p % BS of block table[p // BS]
    want = [[a[1] * BS, a[1] * BS + 1], [b[0] * BS, b[0] * BS + 1]]
    assert view.slots(torch.tensor([[4, 5], [0, 1]])).tolist() == want


def test_view_pads_tables_with_the_trash_block_to_the_longest():
    c = make(8)
    c.allocate("a", 5)
    c.allocate("b", 1)
    assert c.view(["a", "b"]).table.tolist() == [c.tables["a"], c.tables["b"] + [TRASH]]


def test_block_size_must_fit_the_attention_tile():
    for bs in (1, 16, 64, 256):
        PagedKVCache(L, 2, HKV, bs, D, torch.float32)
    with pytest.raises(SelfspecError, match="divide 128 or be a multiple"):
        PagedKVCache(L, 2, HKV, 24, D, torch.float32)
