"""Paged attention in plain torch: the CPU reference that the CUDA kernels must match.

This module fixes the KV-cache layout shared by the CPU executor, the CUDA kernels in
``graphpar/backends/cuda/paged_attention.cu`` and their launcher
``graphpar/backends/cuda/paged_attention.py``:

``key_cache``, ``value_cache``
    ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous, same dtype as the
    queries (fp32, fp16 or bf16). One physical block holds ``block_size`` consecutive tokens of
    one sequence; a token's key for all kv heads is one contiguous row of
    ``num_kv_heads * head_size`` elements, so a new token is written with one copy.
``block_tables``
    int32 ``[num_seqs, max_blocks_per_seq]``: entry ``[s, j]`` is the physical block holding
    tokens ``j * block_size ... (j + 1) * block_size - 1`` of sequence ``s``. Entries past
    ``ceil(context_lens[s] / block_size)`` are never read (they may hold anything, e.g. -1).
``context_lens``
    int32 ``[num_seqs]``: tokens already in the cache for each sequence (for a decode step this
    includes the token being decoded, whose K/V ``reshape_and_cache`` wrote first).
``slot_mapping``
    int64 or int32 ``[num_tokens]``: ``slot = physical_block * block_size + offset``; ``-1``
    skips the token (padding).

Grouped-query attention: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``
(MHA when the two counts are equal, MQA when there is one kv head).

Every function computes in fp32 and casts the result back to the input dtype. Nothing here is
device-specific: the functions run on CUDA tensors too (the CUDA launcher uses
``paged_prefill_attention`` as is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeAlias

import torch

__all__ = [
    "BlockCopies",
    "BlockPair",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_SIZES",
    "allocate_kv_cache",
    "block_copy_pairs",
    "check_cache_write",
    "check_decode_query",
    "check_kv_caches",
    "copy_blocks",
    "gather_sequence_kv",
    "kv_cache_shape",
    "num_kv_heads_for",
    "paged_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
]

#: Head sizes the CUDA kernels are instantiated for. The torch reference accepts any size.
SUPPORTED_HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 128, 256)


class BlockPair(Protocol):
    """Anything with ``src`` and ``dst`` block ids (graphpar.serving.kv_cache_manager.BlockCopy)."""

    src: int
    dst: int


#: Block copies as an int ``[num_pairs, 2]`` tensor, ``(src, dst)`` tuples, objects with
#: ``src``/``dst``, or a mapping ``src -> dst`` / ``src -> [dst, ...]``.
BlockCopies: TypeAlias = (
    torch.Tensor | Sequence[tuple[int, int] | BlockPair] | Mapping[int, int | Sequence[int]]
)

#: dtypes the CUDA kernels are instantiated for.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int, int]:
    """Shape of one key (or value) cache: ``[num_blocks, block_size, num_kv_heads, head_size]``."""
    return (num_blocks, block_size, num_kv_heads, head_size)


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed ``(key_cache, value_cache)`` pair in this module's layout."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    return (
        torch.zeros(shape, dtype=dtype, device=device),
        torch.zeros(shape, dtype=dtype, device=device),
    )


def check_kv_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Raise ValueError unless the two caches are 4-D with one shape and dtype."""
    if key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be [num_blocks, block_size, num_kv_heads, head_size], "
            f"got shape {tuple(key_cache.shape)}"
        )
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype} must have one shape and dtype"
        )


def check_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ValueError unless ``key``/``value`` are ``[num_tokens, num_kv_heads, head_size]``
    of the caches' dtype and ``slot_mapping`` is ``[num_tokens]`` (every implementation's
    ``reshape_and_cache`` checks this)."""
    _, _, num_kv_heads, head_size = key_cache.shape
    expected = (key.shape[0], num_kv_heads, head_size)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
            f"[num_tokens, num_kv_heads={num_kv_heads}, head_size={head_size}]"
        )
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype} differs from cache dtype {key_cache.dtype}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")


def check_decode_query(
    query: torch.Tensor, key_cache: torch.Tensor, num_kv_heads: int | None
) -> int:
    """Raise ValueError unless ``query`` is ``[num_seqs, num_heads, head_size]`` with the cache's
    head size and a multiple of its kv heads; return the cache's kv-head count."""
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_seqs, num_heads, head_size], got {tuple(query.shape)}"
        )
    head_size, cache_head_size = query.shape[2], key_cache.shape[3]
    if head_size != cache_head_size:
        raise ValueError(f"query head_size {head_size} != cache head_size {cache_head_size}")
    return num_kv_heads_for(key_cache, query.shape[1], num_kv_heads)


def num_kv_heads_for(key_cache: torch.Tensor, num_heads: int, num_kv_heads: int | None) -> int:
    """The cache's kv-head count, checked against ``num_kv_heads`` and dividing ``num_heads``."""
    cache_kv_heads = key_cache.shape[2]
    if num_kv_heads is not None and num_kv_heads != cache_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} but the cache holds {cache_kv_heads}")
    if num_heads % cache_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={cache_kv_heads}"
        )
    return cache_kv_heads


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V into their cache slots, in place.

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_size]`` (any strides), same dtype as
    the caches. Token ``i`` goes to slot ``slot_mapping[i]`` (block ``slot // block_size``,
    offset ``slot % block_size``); slot ``-1`` is skipped. Slots must be distinct.
    """
    check_kv_caches(key_cache, value_cache)
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    _, _, num_kv_heads, head_size = key_cache.shape
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, key[keep])
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, value[keep])


def gather_sequence_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V as contiguous ``[context_len, num_kv_heads, head_size]``."""
    block_size = key_cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].to(device=key_cache.device, dtype=torch.long)
    k = key_cache[blocks].flatten(0, 1)[:context_len]
    v = value_cache[blocks].flatten(0, 1)[:context_len]
    return k, v


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_kv_heads: int | None = None,
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache (PagedAttention Eq. 4).

    Returns ``[num_seqs, num_heads, head_size]`` in ``query``'s dtype.

    ``query``: ``[num_seqs, num_heads, head_size]``, one new token per sequence, which attends
    to the ``context_lens[s]`` cached tokens (its own K/V included: causal by construction).
    With ``K_j``/``V_j`` the ``j``-th block of a sequence's keys/values, fetched through
    ``block_tables``, this computes ``A_j = exp(q K_j^T * scale) / sum_t exp(q K_t^T * scale) 1``
    and ``o = sum_j A_j V_j`` over the ``ceil(context_len / block_size)`` blocks, with the slots
    of the last block at or past ``context_len`` masked out. The softmax is the usual
    max-subtracted one over all blocks at once. A sequence with ``context_len == 0`` gets zeros.

    Vectorised over sequences: every sequence's blocks are gathered, padded to the longest,
    into one fp32 ``[num_kv_heads, num_seqs, max_blocks * block_size, head_size]`` tensor per
    K and V, and the attention is two batched matmuls.
    """
    check_kv_caches(key_cache, value_cache)
    kv_heads = check_decode_query(query, key_cache, num_kv_heads)
    num_seqs, num_heads, head_size = query.shape
    block_size = key_cache.shape[1]
    group = num_heads // kv_heads
    device = query.device

    lens = context_lens.to(device=device, dtype=torch.long)
    blocks_per_seq = (lens + block_size - 1) // block_size
    max_blocks = int(blocks_per_seq.max()) if num_seqs else 0
    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float32, device=device)
    if max_blocks == 0:
        return out.to(query.dtype)

    # Token t of sequence s is slot table[s, t // B] * B + t % B. Positions at or past the
    # context length (the tail of the last block, padding up to the longest sequence) are
    # masked below; they read token 0's slot instead, so stale cache contents (NaN included)
    # never reach the sum.
    num_positions = max_blocks * block_size
    position = torch.arange(num_positions, device=device)
    past_end = position[None, :] >= lens[:, None]  # [S, T]
    table = block_tables[:, :max_blocks].to(device=device, dtype=torch.long)
    slots = table[:, position // block_size] * block_size + position % block_size
    slots = torch.where(past_end, slots[:, :1], slots)
    slots = torch.where((lens > 0)[:, None], slots, torch.zeros_like(slots))

    # Gather K_j, V_j for every block j straight into [Hkv, S, T, D] (T = blocks x B), the
    # batch-of-matrices layout matmul wants, then widen to fp32.
    k = key_cache.reshape(-1, kv_heads, head_size).transpose(0, 1)[:, slots].float()
    v = value_cache.reshape(-1, kv_heads, head_size).transpose(0, 1)[:, slots].float()
    q = query.float().view(num_seqs, kv_heads, group, head_size).transpose(0, 1)

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [Hkv, S, G, T]: q K_j^T, all j
    scores.masked_fill_(past_end[None, :, None, :], float("-inf"))
    attn = torch.softmax(scores, dim=-1)  # A_j: one denominator summed over all blocks
    o = torch.matmul(attn, v)  # sum_j A_j V_j: [Hkv, S, G, D]
    o = torch.where((lens > 0)[None, :, None, None], o, torch.zeros_like(o))  # 0/0 rows
    o = o.transpose(0, 1)
    return o.reshape(num_seqs, num_heads, head_size).to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_kv_heads: int | None = None,
) -> torch.Tensor:
    """Prefill (or chunked-prefill) attention over a paged cache; returns ``query``'s shape.

    ``query``: ``[num_tokens, num_heads, head_size]``, the new tokens of all sequences
    concatenated; sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s + 1]``
    (``query_start_loc`` is ``[num_seqs + 1]``, starting at 0). The new tokens' K/V must already
    be in the cache (``reshape_and_cache`` first), and ``context_lens[s]`` counts them, so the
    ``n`` new tokens sit at positions ``context_lens[s] - n ... context_lens[s] - 1``. New token
    ``i`` attends to every cached token at a position ``<= context_lens[s] - n + i``: all
    previously cached context (a shared prefix, an earlier chunk) and, causally, the new tokens
    up to itself. Decode is the case ``n == 1``.

    One vectorised attention per sequence (a Python loop over sequences, not tokens).
    """
    check_kv_caches(key_cache, value_cache)
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}"
        )
    num_tokens, num_heads, head_size = query.shape
    kv_heads = num_kv_heads_for(key_cache, num_heads, num_kv_heads)
    group = num_heads // kv_heads
    starts = [int(x) for x in query_start_loc.tolist()]
    lens = [int(x) for x in context_lens.tolist()]
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1] = [{len(lens) + 1}] from 0 to "
            f"num_tokens={num_tokens}, got {starts}"
        )
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float32, device=query.device)
    for s, context_len in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        n = hi - lo
        if n == 0:
            continue
        if n > context_len:
            raise ValueError(
                f"sequence {s} has {n} new tokens but context_len {context_len}; "
                "context_lens must include the new tokens"
            )
        k, v = gather_sequence_kv(key_cache, value_cache, block_tables[s], context_len)
        q = query[lo:hi].float().view(n, kv_heads, group, head_size)
        scores = torch.einsum("nkgd,tkd->kgnt", q, k.float()) * scale
        q_pos = torch.arange(context_len - n, context_len, device=query.device)
        future = torch.arange(context_len, device=query.device)[None, :] > q_pos[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        o = torch.einsum("kgnt,tkd->nkgd", attn, v.float())
        out[lo:hi] = o.reshape(n, num_heads, head_size)
    return out.to(query.dtype)


def block_copy_pairs(
    src_to_dst: BlockCopies,
) -> torch.Tensor:
    """``(src, dst)`` block pairs as int64 ``[num_pairs, 2]`` on the CPU.

    Raises ValueError if a destination repeats or is also a source: the copies of one call are
    unordered (one GPU launch), so such a batch would have no defined result.
    """
    if isinstance(src_to_dst, Mapping):
        pairs: list[tuple[int, int]] = []
        for src, dsts in src_to_dst.items():
            for dst in [dsts] if isinstance(dsts, int) else dsts:
                pairs.append((int(src), int(dst)))
        table = torch.tensor(pairs, dtype=torch.long).view(-1, 2)
    elif isinstance(src_to_dst, torch.Tensor):
        table = src_to_dst.detach().to("cpu", torch.long).view(-1, 2)
    else:
        pairs = [(p.src, p.dst) if hasattr(p, "dst") else tuple(p) for p in src_to_dst]
        table = torch.tensor(pairs, dtype=torch.long).view(-1, 2)
    dst = table[:, 1].tolist()
    if len(set(dst)) != len(dst):
        raise ValueError("copy_blocks: a destination block appears twice")
    if set(dst) & set(table[:, 0].tolist()):
        raise ValueError("copy_blocks: a destination block is also a source in the same call")
    return table


def copy_blocks(
    caches: Sequence[torch.Tensor],
    src_to_dst: BlockCopies,
) -> None:
    """Copy whole physical blocks (copy-on-write), in place, in every cache of ``caches``.

    ``caches``: any tensors indexed by physical block on dim 0 (typically every layer's key and
    value cache). ``src_to_dst``: see :data:`BlockCopies` (e.g. the runtime's ``BlockCopy``
    list). No destination may also be a source, and none may repeat.
    """
    table = block_copy_pairs(src_to_dst)
    if table.numel() == 0:
        return
    for cache in caches:
        src = table[:, 0].to(cache.device)
        dst = table[:, 1].to(cache.device)
        cache.index_copy_(0, dst, cache.index_select(0, src))
