"""The CUDA source of the paged-attention kernels, run on the CPU through a host emulation.

cuda_host_emulation.h turns each CUDA thread into a fiber with real warp shuffles and block
barriers, so the kernels' own indexing, online softmax, split-K reduce and the launcher's
argument packing (graphpar.backends.cuda.paged_attention) are checked against the torch
reference without a GPU. It checks logic, not speed, memory coalescing or races.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from paged_testutil import HostEmulationRunner, build_host_emulator, dense_decode, make_paged_batch

from graphpar.backends.cuda.paged_attention import (
    CupyRunner,
    PagedAttentionKernels,
    head_chunks,
)
from graphpar.errors import BackendError, GenerationError
from graphpar.ir import paged_reference as ref

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1e-2),
}


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return HostEmulationRunner(build_host_emulator(tmp_path_factory.mktemp("emu")))


@pytest.fixture
def kernels(runner):
    runner.launches.clear()
    return PagedAttentionKernels(runner)


def _run(kernels, batch, **kw):
    return kernels.paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        batch.scale,
        **kw,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", ref.SUPPORTED_HEAD_SIZES)
def test_every_instantiation_matches_reference(kernels, head_size, dtype):
    """Each (dtype, head size) kernel, single-pass and split-K, MQA, with an empty sequence."""
    batch = make_paged_batch([17, 40, 0], 2, 1, head_size, 16, dtype, seed=head_size)
    want = dense_decode(batch)
    single = _run(kernels, batch, use_split=False)
    split = _run(kernels, batch, use_split=True, partition_size=16)  # 2 and 3 partitions
    torch.testing.assert_close(single.float(), want, **TOLERANCE[dtype])
    torch.testing.assert_close(split.float(), want, **TOLERANCE[dtype])
    names = [launch.kernel for launch in kernels.runner.launches]
    suffix = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    assert names == [f"paged_attention_{suffix}_h{head_size}"] * 2 + [
        f"paged_attention_reduce_{suffix}"
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", ref.SUPPORTED_HEAD_SIZES)
def test_every_instantiation_matches_reference_with_gqa_and_mha(kernels, head_size, dtype):
    """Each kernel with a group of 4 query heads per kv head (one block computes all four) and
    with MHA (a group of one, its rows split over all 128 threads), single pass and split-K."""
    for num_heads, num_kv_heads in ((8, 2), (3, 3)):
        batch = make_paged_batch([37, 1, 20], num_heads, num_kv_heads, head_size, 8, dtype,
                                 seed=head_size + num_heads)
        want = dense_decode(batch)
        single = _run(kernels, batch, use_split=False)
        split = _run(kernels, batch, use_split=True, partition_size=16)
        torch.testing.assert_close(single.float(), want, **TOLERANCE[dtype])
        torch.testing.assert_close(split.float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [8, 32])
def test_gqa_long_context_chooses_split_k(kernels, block_size):
    """Contexts over 512 tokens go through split-K by default; shorter ones do not."""
    batch = make_paged_batch([600, 5], 8, 2, 128, block_size, torch.float16, seed=block_size)
    out = _run(kernels, batch)
    # attention: a block per (kv head, sequence, partition); reduce: per (query head, sequence)
    assert [launch.grid for launch in kernels.runner.launches] == [(2, 2, 2), (8, 2, 1)]
    torch.testing.assert_close(out.float(), dense_decode(batch), **TOLERANCE[torch.float16])
    kernels.runner.launches.clear()
    short = make_paged_batch([300, 5], 4, 4, 64, block_size, torch.float32, seed=1)
    torch.testing.assert_close(_run(kernels, short), dense_decode(short), atol=1e-5, rtol=1e-5)
    assert len(kernels.runner.launches) == 1


@pytest.mark.parametrize("split", [False, True], ids=["single", "split_k"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (32, 8), (8, 1), (4, 4)])
def test_a_decode_step_reads_each_kv_head_once(kernels, num_heads, num_kv_heads, split):
    """One block computes every query head of its kv head, so a decode step reads each
    sequence's K and V rows once per kv head: exactly sum(context_len) x kv_heads x head_size
    x 2 x itemsize bytes (rows up to the context length, not whole cache blocks; split-K
    partitions are disjoint). One block per query head read num_heads / num_kv_heads times that."""
    lens = [17, 40, 0, 33]
    for dtype, head_size in [(torch.float16, 128), (torch.float32, 80), (torch.bfloat16, 256)]:
        batch = make_paged_batch(lens, num_heads, num_kv_heads, head_size, 16, dtype, seed=7)
        kernels.runner.kv_bytes_read()  # starts a new count
        out = _run(kernels, batch, use_split=split, partition_size=16)
        once = sum(lens) * num_kv_heads * head_size * 2 * batch.key_cache.element_size()
        assert kernels.runner.kv_bytes_read() == once, (dtype, head_size)
        torch.testing.assert_close(out.float(), dense_decode(batch), **TOLERANCE[dtype])


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size", "chunks"),
                         [(16, 1, 256, 2), (48, 2, 128, 2), (40, 1, 64, 2), (27, 1, 80, 2)])
def test_a_group_larger_than_a_block_is_split_into_chunks(kernels, num_heads, num_kv_heads,
                                                          head_size, chunks):
    """A GQA group over ACC_PER_BLOCK / head_size heads runs as even chunks of heads, each
    reading its kv head's K/V once (27 heads of size 80: chunks of 14 and 13)."""
    assert head_chunks(num_heads, num_kv_heads, head_size)[0] == chunks
    batch = make_paged_batch([37, 5], num_heads, num_kv_heads, head_size, 8, torch.float32,
                             seed=num_heads)
    kernels.runner.kv_bytes_read()
    for split in (False, True):
        out = _run(kernels, batch, use_split=split, partition_size=16)
        torch.testing.assert_close(out, dense_decode(batch), atol=1e-5, rtol=1e-5)
    once = 42 * num_kv_heads * head_size * 2 * 4
    assert kernels.runner.kv_bytes_read() == 2 * chunks * once
    assert kernels.runner.launches[0].grid == (num_kv_heads * chunks, 2, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reshape_and_cache_matches_reference(kernels, dtype):
    torch.manual_seed(0)
    kv_heads, head_size, block_size, tokens = 2, 80, 4, 7
    qkv = torch.randn(tokens, 3 * kv_heads, head_size).to(dtype)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]  # strided views
    slots = torch.tensor([5, 0, -1, 11, 3, 8, 1], dtype=torch.int32)
    want_k, want_v = ref.allocate_kv_cache(4, block_size, kv_heads, head_size, dtype)
    got_k, got_v = ref.allocate_kv_cache(4, block_size, kv_heads, head_size, dtype)
    ref.reshape_and_cache(key, value, want_k, want_v, slots)
    kernels.reshape_and_cache(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_copy_blocks_matches_reference(kernels):
    torch.manual_seed(1)
    caches = [torch.randn(6, 4, 2, 64).half() for _ in range(2)] + [torch.randn(6, 8, 1, 128)]
    want = [c.clone() for c in caches]
    pairs = {0: [3, 5], 2: 4}
    ref.copy_blocks(want, pairs)
    kernels.copy_blocks(caches, pairs)
    assert len(kernels.runner.launches) == 1  # one launch for every cache and pair
    for got, expected in zip(caches, want, strict=True):
        assert torch.equal(got, expected)


def test_unsupported_head_size_is_a_generation_error(kernels):
    batch = make_paged_batch([3], 2, 2, 112, 16)
    with pytest.raises(GenerationError, match="64, 80, 96, 128, 256"):
        _run(kernels, batch)


def test_cupy_runner_without_cupy_or_gpu_is_a_backend_error():
    try:
        import cupy  # noqa: F401

        if torch.cuda.is_available():
            pytest.skip("CuPy and a GPU are present")
    except ImportError:
        pass
    with pytest.raises(BackendError, match="CuPy|GPU"):
        CupyRunner().module(0)
    batch = make_paged_batch([3], 2, 2, 64, 16)
    with pytest.raises(BackendError, match="CUDA tensors"):
        _run(PagedAttentionKernels(), batch)


def test_an_understated_max_context_len_is_an_error_or_still_exact(kernels):
    """Checked (host metadata): a clear error. Unchecked (device metadata): the launched
    partitions are too few, and the last one takes the tail, so the output is still right."""
    batch = make_paged_batch([70, 9], 4, 2, 64, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match="max_context_len=20 is below context length 70"):
        _run(kernels, batch, use_split=True, partition_size=16, max_context_len=20)
    out = _run(kernels, batch, use_split=True, partition_size=16, max_context_len=20,
               check=False)
    assert kernels.runner.launches[-2].grid == (2, 2, 2)  # 2 partitions for 5 needed
    torch.testing.assert_close(out, dense_decode(batch), atol=1e-5, rtol=1e-5)


def test_bounds_are_checked_before_launch(kernels):
    batch = make_paged_batch([20, 9], 2, 2, 64, 8, torch.float32, seed=4)
    tables = batch.block_tables.clone()
    tables[1, 0] = batch.key_cache.shape[0]  # one past the pool
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = .* is not a block"):
        kernels.paged_attention(batch.query, batch.key_cache, batch.value_cache, tables,
                                batch.context_lens, batch.scale)
    too_long = torch.tensor([20, tables.shape[1] * 8 + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"context_lens\[1\] = .* does not fit a block table"):
        kernels.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                batch.block_tables, too_long, batch.scale)
    k, v = ref.allocate_kv_cache(4, 4, 2, 64, torch.float32)
    key = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 16 is outside the cache's 16"):
        kernels.reshape_and_cache(key, key, k, v, torch.tensor([3, 16]))
    assert kernels.runner.launches == []  # nothing reached the kernels


def test_the_decode_launch_reads_no_device_value(kernels, monkeypatch):
    """With max_context_len given and device-side metadata (check=False), building and running
    the decode launches converts no tensor to a Python number (each would be a device sync)."""
    batch = make_paged_batch([600, 5], 8, 2, 64, 16, torch.float32, seed=5)
    reads = []
    for name in ("item", "tolist", "__int__", "__index__", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    out = _run(kernels, batch, max_context_len=608, check=False)
    assert reads == []
    _run(kernels, batch, check=False)  # without the bound the launcher has to read one
    assert reads
    monkeypatch.undo()
    torch.testing.assert_close(out, dense_decode(batch), atol=1e-5, rtol=1e-5)


def test_paged_ops_passes_the_table_bound_to_the_kernels(monkeypatch):
    """The op, run by the backend, hands the CUDA kernels the table width (blocks x block size)
    as the bound."""
    from graphpar.backends import paged

    seen = {}

    class Recorder:
        @staticmethod
        def paged_attention(query, *args, **kwargs):
            seen.update(kwargs)
            return query

    monkeypatch.setattr(paged, "paged_kernels", lambda tensor, kernel: Recorder)
    batch = make_paged_batch([20, 9], 2, 2, 64, 8, torch.float32)
    paged.KERNEL_OPS["paged_attention"](batch.query, batch.key_cache, batch.value_cache,
                               batch.block_tables, batch.context_lens, scale=1.0)
    assert seen == {"max_context_len": batch.block_tables.shape[1] * 8}
