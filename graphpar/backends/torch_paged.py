"""Paged attention in a few batched torch ops: the fast path where there is no CUDA kernel.

A :class:`graphpar.backends.paged.PagedKernels`, on the cache layout of
:mod:`graphpar.ir.paged_reference` (the ground truth the CUDA kernels are tested against);
tests check this module against it. The
reference favours obviously-correct code (a loop over sequences for prefill, one gather per
layer built from scratch); here each call is a handful of tensor ops over the whole batch:

* decode: gather every sequence's blocks ``[seqs, blocks * block_size, kv_heads, D]`` (the
  block table read of Eq. 4), then one fused ``scaled_dot_product_attention`` with the query
  heads of a kv head as its query rows and a context-length mask;
* prefill: the new tokens are scattered into a ``[seqs, max_new, heads, D]`` batch, attend to
  their sequence's gathered context under a causal mask at their absolute positions, and are
  gathered back. A mixed step (prompts or prompt chunks beside decode rows) pads the two kinds
  apart, so a decode row costs one query, not a long prompt's length.

Results are computed in fp32 and cast back to the query's dtype, like the reference.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from graphpar.ir.paged_reference import copy_blocks, gather_sequence_kv

__all__ = ["copy_blocks", "gather_sequence_kv", "paged_attention", "paged_prefill_attention",
           "reshape_and_cache"]


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[seqs, blocks * block_size, kv_heads, D]``: each sequence's blocks, in order."""
    seqs, num_blocks = blocks.shape
    return cache.index_select(0, blocks.reshape(-1)).view(
        seqs, num_blocks * cache.shape[1], cache.shape[2], cache.shape[3])


class _Memo:
    """The last step's block-table metadata: every layer of a step passes the same block tables
    and lengths, so the index and mask tensors built from them are built once per step (what
    vLLM's attention metadata does). Keyed by tensor identity and version; the key holds the
    tensors, so an id is never reused while it is cached."""

    def __init__(self) -> None:
        self.entry: tuple[tuple, object] = ((), None)  # (key, value), replaced as one

    def get(self, build, *tensors: torch.Tensor, extra: tuple = ()):
        key = tuple((t, t._version) for t in tensors) + extra
        cached, value = self.entry
        if len(key) == len(cached) and all(
                (a[0] is b[0] and a[1] == b[1]) if isinstance(a, tuple) else a == b
                for a, b in zip(key, cached)):
            return value
        value = build()
        self.entry = (key, value)
        return value


class _StepMemos(threading.local):
    """Each thread's memos. Engines of several models step at once on their own threads in
    one process (`graphpar serve --model a=... --model b=...`); memos shared between them
    would hand one engine's layers the other's block tables."""

    def __init__(self) -> None:
        self.decode = _Memo()
        self.prefill = _Memo()
        self.slots = _Memo()


_memos = _StepMemos()


def _slots(slot_mapping: torch.Tensor, device: torch.device):
    """Slots as int64, and the mask of tokens to write when some are -1 (padding)."""
    slots = slot_mapping.to(device=device, dtype=torch.long)
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        return slots[keep], keep
    return slots, None


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token i's K/V ``[tokens, kv_heads, D]`` at flat slot ``slot_mapping[i]`` (-1
    skips), in place."""
    _, _, kv_heads, head_size = key_cache.shape
    slots, keep = _memos.slots.get(lambda: _slots(slot_mapping, key_cache.device), slot_mapping,
                                  extra=(key_cache.device,))
    if keep is not None:
        key, value = key[keep], value[keep]
    key_cache.view(-1, kv_heads, head_size).index_copy_(0, slots, key)
    value_cache.view(-1, kv_heads, head_size).index_copy_(0, slots, value)


def _decode_metadata(block_tables, context_lens, block_size, device):
    """The step's flat block ids (each sequence's first blocks, up to the longest context) and
    one additive mask, -inf past each sequence's length. A sequence with no context (padding)
    attends to its padded blocks and is zeroed after (``empty``), so no row is all -inf.
    The lengths are read once into Python: a handful of small tensor ops per step."""
    lens_list = context_lens.tolist()
    longest = max(lens_list, default=0)
    num_blocks = -(-longest // block_size)
    blocks = block_tables[:, :num_blocks].reshape(-1).to(device=device, dtype=torch.long)
    lens = context_lens.to(device=device, dtype=torch.long)
    past_end = torch.arange(num_blocks * block_size, device=device) >= lens[:, None]
    empty = None
    if longest and min(lens_list) == 0:
        no_context = lens == 0
        past_end &= ~no_context[:, None]
        empty = no_context[:, None, None, None]
    bias = torch.zeros(past_end.shape, device=device).masked_fill_(past_end, float("-inf"))
    return longest, blocks, bias[:, None, None, :], empty


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    num_kv_heads: int | None = None, *,
                    max_context_len: int | None = None) -> torch.Tensor:
    """Decode attention (one query per sequence) over a paged cache: ``[seqs, heads, D]``
    (``max_context_len``, a bound the kernels use to size their launch, is not needed here)."""
    seqs, heads, head_size = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    longest, blocks, bias, empty = _memos.decode.get(
        lambda: _decode_metadata(block_tables, context_lens, block_size, query.device),
        block_tables, context_lens, extra=(block_size, query.device))
    if seqs == 0 or longest == 0:
        return torch.zeros_like(query)
    width = blocks.shape[0] // seqs * block_size
    k = key_cache.index_select(0, blocks).view(seqs, width, kv_heads, head_size).transpose(1, 2)
    v = value_cache.index_select(0, blocks).view(seqs, width, kv_heads, head_size).transpose(1, 2)
    q = query.view(seqs, kv_heads, heads // kv_heads, head_size)  # a kv head's queries as rows
    if query.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    out = out.view(seqs, heads, head_size)
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _prefill_metadata(block_tables, context_lens, query_start_loc, tokens, block_size, device):
    starts = query_start_loc.to(device=device, dtype=torch.long)
    lens = context_lens.to(device=device, dtype=torch.long)
    new = starts[1:] - starts[:-1]
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=device), new)
    row = torch.arange(tokens, device=device) - starts[seq_of]
    max_new, max_len = int(new.max()), int(lens.max())
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].to(device=device, dtype=torch.long)
    q_pos = (lens - new)[:, None] + torch.arange(max_new, device=device)[None, :]  # [N, Q]
    k_pos = torch.arange(num_blocks * block_size, device=device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < lens[:, None,
                                                                                      None])
    mask |= ~mask.any(dim=-1, keepdim=True)  # padding rows: anything finite, dropped below
    return seq_of, row, max_new, blocks, mask[:, None]


def _prefill_groups(block_tables, context_lens, query_start_loc, tokens, block_size, device):
    """The step's sequences in groups padded apart: those with several new tokens (prompts
    and prompt chunks) and those with at most one (decode rows of a mixed step, padding), so a
    decode row is not padded to a long prompt's length. Each group: the query rows it takes
    (None: all of them, in order) and its :func:`_prefill_metadata`."""
    starts = query_start_loc.to(device=device, dtype=torch.long)
    new = starts[1:] - starts[:-1]
    several = new > 1
    if bool(several.all()) or not bool(several.any()):
        return [(None, _prefill_metadata(block_tables, context_lens, query_start_loc, tokens,
                                         block_size, device))]
    groups = []
    for chosen in (several, ~several):
        seqs = chosen.nonzero().flatten()
        sub_new = new[seqs]
        count = int(sub_new.sum())
        if count == 0:  # padding sequences only
            continue
        sub_starts = torch.zeros(len(seqs) + 1, dtype=torch.long, device=device)
        sub_starts[1:] = torch.cumsum(sub_new, 0)
        rows = torch.repeat_interleave(starts[seqs] - sub_starts[:-1], sub_new) + \
            torch.arange(count, device=device)
        groups.append((rows, _prefill_metadata(block_tables[seqs.to(block_tables.device)],
                                               context_lens[seqs.to(context_lens.device)],
                                               sub_starts, count, block_size, device)))
    return groups


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, num_kv_heads: int | None = None) -> torch.Tensor:
    """Prefill attention: sequence s's new tokens (rows ``query_start_loc[s]:[s+1]``, the last of
    its ``context_lens[s]`` cached tokens) attend causally to its whole context."""
    tokens = query.shape[0]
    block_size = key_cache.shape[1]
    if tokens == 0:
        return torch.zeros_like(query)
    groups = _memos.prefill.get(
        lambda: _prefill_groups(block_tables, context_lens, query_start_loc, tokens,
                                block_size, query.device),
        block_tables, context_lens, query_start_loc, extra=(tokens, block_size, query.device))
    if groups[0][0] is None:
        return _prefill_group(query, key_cache, value_cache, groups[0][1], scale)
    out = torch.empty_like(query)
    for rows, metadata in groups:
        out[rows] = _prefill_group(query[rows], key_cache, value_cache, metadata, scale)
    return out


def _prefill_group(query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
    tokens, heads, head_size = query.shape
    kv_heads = key_cache.shape[2]
    seq_of, row, max_new, blocks, mask = metadata
    q = query.new_zeros(blocks.shape[0], max_new, heads, head_size)
    q[seq_of, row] = query
    k = _gather(key_cache, blocks).transpose(1, 2)  # [N, Hkv, T, D]
    v = _gather(value_cache, blocks).transpose(1, 2)
    q = q.transpose(1, 2)
    if query.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=heads != kv_heads)
    return out.transpose(1, 2)[seq_of, row].to(query.dtype)
