"""Paged-attention kernels: the `PagedKernels` protocol and which implementation runs a tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from graphpar.backends import torch_paged
from graphpar.errors import BackendError
from graphpar.ir import paged_reference as reference_paged
from graphpar.ir.paged_ops import KERNELS, paged_attention_with, reshape_and_cache_with
from graphpar.ir.paged_reference import BlockCopies

__all__ = ["KERNELS", "PagedKernels", "cuda_kernels_available", "paged_kernels"]



class PagedKernels(Protocol):
    """The paged-attention operations every implementation provides, on the cache layout of
    :mod:`graphpar.ir.paged_reference` (the ground truth, documented there):
    :mod:`~graphpar.ir.paged_reference`, :mod:`~graphpar.backends.torch_paged` and
    :mod:`graphpar.backends.cuda.paged_attention`."""

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write token i's K/V ``[tokens, kv_heads, D]`` at flat slot ``slot_mapping[i]`` (-1
        skips), in place."""

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float,
                        num_kv_heads: int | None = None, *,
                        max_context_len: int | None = None) -> torch.Tensor:
        """Decode attention, one query per sequence: ``[seqs, heads, D]``. ``max_context_len``
        bounds every ``context_lens`` entry (known from shapes, so no implementation has to
        read the tensor back from the device)."""

    def paged_prefill_attention(self, query: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, block_tables: torch.Tensor,
                                context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                                scale: float, num_kv_heads: int | None = None) -> torch.Tensor:
        """Prefill attention: sequence s's rows ``query_start_loc[s]:[s+1]`` attend causally to
        its ``context_lens[s]`` cached tokens."""

    def copy_blocks(self, caches: Sequence[torch.Tensor], src_to_dst: BlockCopies) -> None:
        """Copy whole physical blocks in every cache of ``caches`` (copy-on-write), in place."""


_cupy_ok: bool | None = None


def cuda_kernels_available() -> bool:
    """Whether CuPy is installed, so the CUDA kernels can be compiled and launched."""
    global _cupy_ok
    if _cupy_ok is None:
        try:
            import cupy  # noqa: F401
            _cupy_ok = True
        except ImportError:
            _cupy_ok = False
    return _cupy_ok


def paged_kernels(tensor: torch.Tensor, kernel: str = "auto") -> PagedKernels:
    """The implementation that runs the paged ops on ``tensor``'s device for ``kernel``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "reference":
        return reference_paged
    use_cuda = tensor.is_cuda and cuda_kernels_available()
    if kernel == "torch" or (kernel == "auto" and not use_cuda):
        return torch_paged
    if not tensor.is_cuda:
        raise BackendError(f"kernel='cuda' needs CUDA tensors, got a tensor on {tensor.device}")
    from graphpar.backends.cuda.paged_attention import default_kernels

    return default_kernels()


def _reshape_and_cache(key_cache, value_cache, key, value, slot_mapping, kernel="auto"):
    return reshape_and_cache_with(paged_kernels(key_cache, kernel), key_cache, value_cache, key,
                                  value, slot_mapping)


def _paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                     query_start_loc=None, scale=1.0, mode="decode", kernel="auto"):
    return paged_attention_with(paged_kernels(query, kernel), query, key_cache, value_cache,
                                block_tables, context_lens, query_start_loc, scale, mode)


KERNEL_OPS = {"reshape_and_cache": _reshape_and_cache, "paged_attention": _paged_attention}
"""What the interpreter runs for these ops instead of their registry reference: the kernel the
node's `kernel` attribute picks for its tensors' device."""
