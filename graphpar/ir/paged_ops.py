"""IR ops of paged attention: `reshape_and_cache` writes K/V into cache blocks, `paged_attention`
reads them through per-sequence block tables (PagedAttention, SOSP'23, Eq. 4).

The cache layout is that of :mod:`graphpar.ir.paged_reference`: one key and one value
cache per layer, ``[num_blocks, block_size, num_kv_heads, head_size]``; token ``i`` of a batch
lives at flat slot ``slot_mapping[i] = block * block_size + offset``.

In the IR both ops are functional: ``reshape_and_cache`` returns the new caches, which the graph
returns as ``update(%key_cache.i)`` outputs. The implementations write in place and return the
same tensors (the runtime donates the cache buffers, as XLA does with donated arguments), so a
step costs the new tokens' bytes, not a copy of the cache.

Kernels (the ``kernel`` attribute) are chosen by :func:`graphpar.backends.paged.paged_kernels`:
``auto`` (the default) sends CUDA tensors to the CUDA kernels of
:mod:`graphpar.backends.cuda.paged_attention` when CuPy is installed and anything else to the
batched torch path :mod:`graphpar.backends.torch_paged`; ``torch``, ``reference``
(:mod:`graphpar.ir.paged_reference`, the ground truth) and ``cuda`` force one.

`OPS` lists both ops for `graphpar.ir.load_ops`.
"""

from __future__ import annotations

import math

import torch

from graphpar.ir import paged_reference
from graphpar.ir.registry import OpDef, OpKind, Trait
from graphpar.ir.types import TensorType

__all__ = ["KERNELS", "OPS", "PAGED_OPS", "default_scale", "paged_attention_with",
           "reshape_and_cache_with"]

KERNELS = ("auto", "torch", "reference", "cuda")
"""The `kernel` attribute's choices (graphpar.backends.paged.paged_kernels runs them): `auto`
sends CUDA tensors to the CUDA kernels when CuPy is installed and anything else to the batched
torch path; the others force one implementation."""

PAGED_OPS = ("reshape_and_cache", "paged_attention")


# --- reshape_and_cache --------------------------------------------------------------------------

def reshape_and_cache_with(kernels, key_cache, value_cache, key, value, slot_mapping):
    """reshape_and_cache run by `kernels` (a `graphpar.backends.paged.PagedKernels`)."""
    if key_cache.device.type != "meta":
        kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return key_cache, value_cache


def _reshape_and_cache(key_cache, value_cache, key, value, slot_mapping, kernel="auto"):
    # The registry's reference is the pure-torch ground truth; the interpreter runs the
    # kernel the `kernel` attribute picks (graphpar.backends.paged).
    return reshape_and_cache_with(paged_reference, key_cache, value_cache, key, value,
                                  slot_mapping)


def _cache_rule(operands, attrs) -> list[TensorType]:
    key_cache, value_cache, key, value, slots = operands
    if key_cache.rank != 4 or key_cache != value_cache:
        raise TypeError("key_cache and value_cache must be one [num_blocks, block_size, "
                        f"kv_heads, head_size] type, got {key_cache} and {value_cache}")
    expected = (key.shape[0], *key_cache.shape[2:]) if key.rank == 3 else None
    if expected is None or key.shape != expected or value.shape != expected:
        raise TypeError(f"key {key} and value {value} must be [tokens, kv_heads, head_size] "
                        f"matching the cache {key_cache}")
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
        raise TypeError(f"key/value dtype differs from the cache's ({key_cache})")
    if slots.shape != (key.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int [{key.shape[0]}], got {slots}")
    return [key_cache, value_cache]


_RESHAPE_AND_CACHE = OpDef(
    "reshape_and_cache", OpKind.COMPOSITE, _reshape_and_cache, num_outputs=2,
    type_rule=_cache_rule, traits=frozenset({Trait.WRITES_OPERAND}), cost_class="gather",
    # Reads the new K/V rows and writes them into the caches: the caches are not read.
    bytes_rule=lambda o, r, a: 2 * (o[2].nbytes + o[3].nbytes),
    doc="reshape_and_cache(key_cache, value_cache, key, value, slot_mapping) {kernel} -> "
        "new key_cache, value_cache: token i's K/V [tokens, kv_heads, D] written at flat slot "
        "slot_mapping[i] (-1 skips); in place at run time",
)


# --- paged_attention ----------------------------------------------------------------------------

def paged_attention_with(kernels, query, key_cache, value_cache, block_tables, context_lens,
                         query_start_loc=None, scale=1.0, mode="decode"):
    """paged_attention run by `kernels` (a `graphpar.backends.paged.PagedKernels`): decode
    rows past the step's sequences and prefill rows past the last sequence are padding."""
    if query.device.type == "meta":
        return torch.empty_like(query)
    if mode == "decode":
        rows = query.shape[0]
        if rows < block_tables.shape[0]:
            block_tables, context_lens = block_tables[:rows], context_lens[:rows]
        # The table's width bounds every context: no device sync per layer, and a shape-only
        # step (CUDA-graph capturable).
        return kernels.paged_attention(query, key_cache, value_cache, block_tables,
                                       context_lens, scale,
                                       max_context_len=block_tables.shape[1] * key_cache.shape[1])
    used = int(query_start_loc[-1])
    if used == query.shape[0]:
        return kernels.paged_prefill_attention(query, key_cache, value_cache, block_tables,
                                               context_lens, query_start_loc, scale)
    out = torch.zeros_like(query)  # rows past the last sequence are padding
    out[:used] = kernels.paged_prefill_attention(query[:used], key_cache, value_cache,
                                                 block_tables, context_lens, query_start_loc,
                                                 scale)
    return out


def _paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                     query_start_loc=None, scale=1.0, mode="decode", kernel="auto"):
    return paged_attention_with(paged_reference, query, key_cache, value_cache, block_tables,
                                context_lens, query_start_loc, scale, mode)


def _attention_rule(operands, attrs) -> list[TensorType]:
    query, key_cache, value_cache, tables, lens = operands[:5]
    starts = operands[5] if len(operands) > 5 else None
    mode = attrs.get("mode", "decode")
    if query.rank != 3 or key_cache.rank != 4 or key_cache != value_cache:
        raise TypeError(f"query {query} must be [tokens, heads, head_size] and the caches one "
                        f"[num_blocks, block_size, kv_heads, head_size] type")
    tokens, heads, head_size = query.shape
    kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size or heads % kv_heads or query.dtype != key_cache.dtype:
        raise TypeError(f"query {query} does not fit the cache {key_cache} (head size, dtype, "
                        "or heads not a multiple of kv heads)")
    if tables.rank != 2 or lens.shape != (tables.shape[0],):
        raise TypeError(f"block_tables {tables} must be [seqs, max_blocks] and context_lens "
                        f"[seqs], got {lens}")
    if mode == "decode":
        if tables.shape[0] < tokens:
            raise TypeError(f"decode has one query per sequence: {tokens} queries, "
                            f"{tables.shape[0]} block-table rows")
    elif mode == "prefill":
        if starts is None or starts.shape != (tables.shape[0] + 1,):
            raise TypeError(f"prefill needs query_start_loc [seqs + 1] = "
                            f"[{tables.shape[0] + 1}], got {starts}")
    else:
        raise TypeError(f"mode must be 'decode' or 'prefill', got {mode!r}")
    if attrs.get("kernel", "auto") not in KERNELS:
        raise TypeError(f"kernel must be one of {', '.join(KERNELS)}")
    return [query]


def _attention_flops(operands, results, attrs) -> int:
    """Upper bound: every query over a full block table (q k^T and a v, 2 FLOP per MAC)."""
    query, key_cache, _, tables = operands[:4]
    tokens, heads, head_size = query.shape
    context = tables.shape[1] * key_cache.shape[1]
    return 4 * tokens * heads * head_size * context


def _attention_bytes(operands, results, attrs) -> int:
    """The queries, the output, and the K/V blocks the block tables reach (not the whole pool)."""
    query, key_cache, value_cache, tables = operands[:4]
    blocks = tables.numel  # every table entry: one block of K and one of V, at most
    per_block = key_cache.nbytes // key_cache.shape[0] + value_cache.nbytes // value_cache.shape[0]
    return query.nbytes + results[0].nbytes + blocks * per_block


_PAGED_ATTENTION = OpDef(
    "paged_attention", OpKind.COMPOSITE, _paged_attention, type_rule=_attention_rule,
    flop_rule=_attention_flops, cost_class="attention", bytes_rule=_attention_bytes,
    doc="paged_attention(query, key_cache, value_cache, block_tables, context_lens, "
        "query_start_loc?) {scale, mode, kernel}: causal attention of [tokens, heads, D] queries "
        "over K/V read through per-sequence block tables; mode=decode: one query per sequence, "
        "mode=prefill: sequence s owns rows query_start_loc[s]:[s+1], the last of its "
        "context_lens[s] cached tokens (rows past query_start_loc[-1] are padding: zeros); a "
        "sequence with context_lens 0 gets zeros",
)

OPS = [_RESHAPE_AND_CACHE, _PAGED_ATTENTION]


def default_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)

