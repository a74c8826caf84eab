"""The paged-attention CUDA kernels on a GPU (through CuPy) against the torch reference.

Skipped without CuPy or a CUDA GPU.
"""

from __future__ import annotations

import pytest
import torch
from paged_testutil import make_paged_batch

from graphpar.ir import paged_reference as ref

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from graphpar.backends.cuda.paged_attention import default_kernels  # noqa: E402

TOLERANCE = {  # kernel vs reference: both round one fp32 result, summed in different orders
    torch.float32: dict(atol=5e-5, rtol=5e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1e-2),
}
HEADS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}
CUDA = torch.device("cuda")


def _on_gpu(batch):
    return [
        t.to(CUDA)
        for t in (
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.context_lens,
        )
    ]


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("head_size", ref.SUPPORTED_HEAD_SIZES)
def test_decode_kernel_matches_reference(head_size, heads, dtype, split):
    num_heads, num_kv_heads = heads
    lens = [1, 15, 16, 17, 300, 1100, 0]
    batch = make_paged_batch(lens, num_heads, num_kv_heads, head_size, 16, dtype, seed=head_size)
    want = ref.paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        batch.scale,
    )
    q, kc, vc, bt, cl = _on_gpu(batch)
    got = default_kernels().paged_attention(q, kc, vc, bt, cl, batch.scale, use_split=split)
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [8, 32])
def test_default_split_choice_long_context(block_size):
    batch = make_paged_batch([4097, 513, 2], 32, 8, 128, block_size, torch.float16, seed=7)
    want = ref.paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        batch.scale,
    )
    q, kc, vc, bt, cl = _on_gpu(batch)
    got = default_kernels().paged_attention(q, kc, vc, bt, cl, batch.scale, max_context_len=4097)
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOLERANCE[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reshape_and_cache_kernel(dtype):
    torch.manual_seed(0)
    kv_heads, head_size, block_size, tokens = 4, 128, 16, 50
    qkv = torch.randn(tokens, 3 * kv_heads, head_size).to(dtype)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    slots = torch.randperm(8 * block_size)[:tokens]
    slots[::7] = -1
    want_k, want_v = ref.allocate_kv_cache(8, block_size, kv_heads, head_size, dtype)
    ref.reshape_and_cache(key, value, want_k, want_v, slots)
    got_k, got_v = ref.allocate_kv_cache(8, block_size, kv_heads, head_size, dtype, CUDA)
    g = qkv.to(CUDA)
    default_kernels().reshape_and_cache(
        g[:, kv_heads : 2 * kv_heads], g[:, 2 * kv_heads :], got_k, got_v, slots.to(CUDA)
    )
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def test_copy_blocks_kernel():
    torch.manual_seed(1)
    caches = [torch.randn(10, 16, 4, 128).half() for _ in range(4)]
    pairs = [(0, 7), (3, 9), (4, 8)]
    want = [c.clone() for c in caches]
    ref.copy_blocks(want, pairs)
    got = [c.to(CUDA) for c in caches]
    default_kernels().copy_blocks(got, pairs)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


def test_prefill_on_gpu_matches_cpu():
    batch = make_paged_batch([12, 40], 8, 2, 64, 16, torch.float32, seed=3)
    query = torch.randn(10, 8, 64)
    starts = torch.tensor([0, 4, 10], dtype=torch.int32)
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens, starts)
    want = ref.paged_prefill_attention(query, *args, batch.scale)
    got = default_kernels().paged_prefill_attention(query.to(CUDA), *[a.to(CUDA) for a in args],
                                                    batch.scale)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
