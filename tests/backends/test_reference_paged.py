"""The torch paged-attention reference against dense attention (torch SDPA) on gathered K/V."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from paged_testutil import dense_attention, dense_decode, make_paged_batch

from graphpar.ir import paged_reference as ref

TOLERANCE = {  # the reference rounds its fp32 result once to the output dtype
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1e-2),
}
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


@dataclass(frozen=True)
class Copy:  # shaped like graphpar.serving.kv_cache_manager.BlockCopy
    src: int
    dst: int


def _decode(batch):
    return ref.paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        batch.scale,
        batch.key_cache.shape[2],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("head_size", ref.SUPPORTED_HEAD_SIZES)
def test_decode_matches_dense_attention(head_size, heads, dtype):
    num_heads, num_kv_heads = heads
    # lengths: one token, one short of a block, exactly a block, one over, several blocks
    batch = make_paged_batch(
        [1, 15, 16, 17, 70], num_heads, num_kv_heads, head_size, 16, dtype, seed=head_size
    )
    out = _decode(batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), dense_decode(batch), **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_decode_block_sizes(block_size):
    batch = make_paged_batch([3, 33, 100], 6, 3, 64, block_size, seed=block_size)
    torch.testing.assert_close(_decode(batch), dense_decode(batch), atol=1e-5, rtol=1e-5)


def test_decode_ignores_slots_past_context_and_unused_table_entries():
    batch = make_paged_batch([5, 20], 4, 2, 64, 16)
    before = _decode(batch)
    batch.block_tables[0, 1:] = 12345  # garbage past the used blocks
    # noise in the unused tail of each sequence's last block
    last0, last1 = batch.block_tables[0, 0].item(), batch.block_tables[1, 1].item()
    batch.key_cache[last0, 5:] = 1e4
    batch.value_cache[last1, 4:] = float("nan")
    torch.testing.assert_close(_decode(batch), before, atol=0, rtol=0)


def test_empty_context_gives_zeros():
    batch = make_paged_batch([0, 9], 4, 4, 64, 16)
    out = _decode(batch)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1], dense_decode(batch)[1], atol=1e-5, rtol=1e-5)


def test_rejects_heads_not_divisible_by_kv_heads():
    batch = make_paged_batch([4], 6, 4, 64, 16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _decode(batch)


def test_reshape_and_cache_round_trip():
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, head_size = 6, 4, 2, 64
    key_cache, value_cache = ref.allocate_kv_cache(
        num_blocks, block_size, kv_heads, head_size, torch.float16
    )
    assert key_cache.shape == ref.kv_cache_shape(num_blocks, block_size, kv_heads, head_size)
    num_tokens = 9
    # k and v as strided views into one fused [tokens, 3 * kv_heads, head_size] tensor
    qkv = torch.randn(num_tokens, 3 * kv_heads, head_size).half()
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(torch.int32)
    slots[3] = -1  # padding token
    ref.reshape_and_cache(key, value, key_cache, value_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        assert torch.equal(key_cache[block, offset], key[i])
        assert torch.equal(value_cache[block, offset], value[i])
    written = (key_cache != 0).any(-1).any(-1).sum().item()
    assert written == num_tokens - 1  # nothing else touched


def test_reshape_and_cache_then_decode_equals_dense():
    """Write a sequence token by token through slot mappings, then attend over it."""
    torch.manual_seed(1)
    block_size, kv_heads, heads, head_size, length = 8, 2, 4, 128, 29
    key_cache, value_cache = ref.allocate_kv_cache(10, block_size, kv_heads, head_size)
    table = torch.tensor([7, 2, 9, 0], dtype=torch.int32)
    k = torch.randn(length, kv_heads, head_size)
    v = torch.randn(length, kv_heads, head_size)
    pos = torch.arange(length)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    ref.reshape_and_cache(k[:20], v[:20], key_cache, value_cache, slots[:20])  # prefill
    for t in range(20, length):  # decode steps
        ref.reshape_and_cache(k[t : t + 1], v[t : t + 1], key_cache, value_cache, slots[t : t + 1])
    q = torch.randn(1, heads, head_size)
    out = ref.paged_attention(
        q, key_cache, value_cache, table[None], torch.tensor([length], dtype=torch.int32), 0.1
    )
    torch.testing.assert_close(out[0], dense_attention(q, k, v, 0.1)[0], atol=1e-5, rtol=1e-5)
    got_k, got_v = ref.gather_sequence_kv(key_cache, value_cache, table, length)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_reshape_and_cache_rejects_dtype_mismatch():
    key_cache, value_cache = ref.allocate_kv_cache(2, 4, 1, 64, torch.float16)
    k = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="dtype"):
        ref.reshape_and_cache(k, k, key_cache, value_cache, torch.tensor([0]))


@pytest.mark.parametrize(
    "pairs",
    [
        torch.tensor([[1, 4], [3, 0]]),
        [(1, 4), (3, 0)],
        {1: 4, 3: [0]},
        [Copy(1, 4), Copy(3, 0)],
    ],
    ids=["tensor", "list", "mapping", "objects"],
)
def test_copy_blocks_copies_every_cache(pairs):
    torch.manual_seed(2)
    caches = [torch.randn(6, 4, 2, 64) for _ in range(4)]  # 2 layers x (K, V)
    before = [c.clone() for c in caches]
    ref.copy_blocks(caches, pairs)
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[4], b[1]) and torch.equal(c[0], b[3])
        for untouched in (1, 2, 3, 5):
            assert torch.equal(c[untouched], b[untouched])


def test_copy_blocks_rejects_overlapping_pairs():
    caches = [torch.zeros(4, 2, 1, 64)]
    with pytest.raises(ValueError, match="also a source"):
        ref.copy_blocks(caches, [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="twice"):
        ref.copy_blocks(caches, [(0, 2), (1, 2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [64, 128])
def test_prefill_matches_causal_sdpa(head_size, dtype):
    """New tokens after a cached prefix (0, 5 and 20 tokens) attend causally, prefix included."""
    prefix, new = [0, 5, 20], [7, 1, 13]
    lens = [p + n for p, n in zip(prefix, new, strict=True)]
    batch = make_paged_batch(lens, 8, 2, head_size, 16, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(sum(new), 8, head_size, generator=gen).to(dtype)
    starts = torch.tensor([0, 7, 8, 21], dtype=torch.int32)
    out = ref.paged_prefill_attention(
        query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        starts,
        batch.scale,
    )
    assert out.dtype == dtype
    for s in range(3):
        lo, hi = starts[s].item(), starts[s + 1].item()
        want = dense_attention(
            query[lo:hi], batch.keys[s], batch.values[s], batch.scale, causal_offset=prefix[s]
        )
        torch.testing.assert_close(out[lo:hi].float(), want, **TOLERANCE[dtype])


def test_prefill_of_one_token_is_decode():
    batch = make_paged_batch([9, 30], 4, 2, 96, 8, seed=5)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill = ref.paged_prefill_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        starts,
        batch.scale,
    )
    # Two computations of the same scores (prefill's matmul over a block of queries, decode's
    # per-query one) may sum head_size products in different orders, and another CPU's
    # kernels block them differently: the float32 tolerance this file gives every comparison
    # of two computations, not one fitted to this machine's last bits
    torch.testing.assert_close(prefill, _decode(batch), **TOLERANCE[torch.float32])


def test_prefill_rejects_context_shorter_than_new_tokens():
    batch = make_paged_batch([3], 4, 4, 64, 16)
    query = torch.zeros(5, 4, 64)
    with pytest.raises(ValueError, match="context_lens must include the new tokens"):
        ref.paged_prefill_attention(
            query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.context_lens,
            torch.tensor([0, 5]),
            1.0,
        )
