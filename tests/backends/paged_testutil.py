"""Helpers for the paged-attention tests: random paged batches, a dense oracle, a host emulator."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from graphpar.backends.cuda.paged_attention import SOURCE_PATH, Launch
from graphpar.errors import BackendError

HERE = Path(__file__).resolve().parent


@dataclass
class PagedBatch:
    """One decode batch over a paged cache, plus each sequence's K/V gathered independently."""

    query: torch.Tensor  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], unused entries -1
    context_lens: torch.Tensor  # int32 [num_seqs]
    scale: float
    keys: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_size]
    values: list[torch.Tensor]


def make_paged_batch(
    context_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random caches (every slot, used or not, holds noise) with shuffled physical blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq + [1]) + 1  # one spare column, left at -1
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = torch.tensor(physical[start : start + n], dtype=torch.int32)
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(len(context_lens), num_heads, head_size, generator=gen).to(dtype)
    keys, values = [], []
    flat_k = key_cache.reshape(num_blocks * block_size, num_kv_heads, head_size)
    flat_v = value_cache.reshape(num_blocks * block_size, num_kv_heads, head_size)
    for s, c in enumerate(context_lens):
        pos = torch.arange(c)
        slots = tables[s].long()[pos // block_size] * block_size + pos % block_size
        keys.append(flat_k[slots])
        values.append(flat_v[slots])
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables,
        context_lens=torch.tensor(list(context_lens), dtype=torch.int32),
        scale=head_size**-0.5,
        keys=keys,
        values=values,
    )


def dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, causal_offset=None
) -> torch.Tensor:
    """torch SDPA on contiguous K/V in fp32: query [n, H, D], key/value [t, Hkv, D] -> [n, H, D].

    ``causal_offset=None`` lets every query see every key (decode); an int ``o`` lets query
    ``i`` see keys ``<= o + i`` (prefill after ``o`` cached tokens).
    """
    n, num_heads, _ = query.shape
    t, num_kv_heads, _ = key.shape
    if t == 0:
        return torch.zeros(query.shape, dtype=torch.float32)
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)  # [H, n, D]
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    mask = None
    if causal_offset is not None:
        mask = torch.arange(t)[None, :] <= causal_offset + torch.arange(n)[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def dense_decode(batch: PagedBatch) -> torch.Tensor:
    """The oracle for a decode batch, fp32 [num_seqs, num_heads, head_size]."""
    outs = [
        dense_attention(batch.query[s : s + 1], k, v, batch.scale)[0]
        for s, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True))
    ]
    return torch.stack(outs)


# ---------------------------------------------------------------------------------------------
# Host emulation of the CUDA source (cuda_host_emulation.h + cuda_host_harness.cpp).


def build_host_emulator(cache_dir: Path) -> Path:
    """Compile paged_attention.cu for the host with g++; returns the shared library's path."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("g++")
    sources = [SOURCE_PATH, HERE / "cuda_host_emulation.h", HERE / "cuda_host_harness.cpp"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    lib = cache_dir / f"paged_attention_emu_{digest}.so"
    if not lib.exists():
        cmd = [
            compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-Wall", "-Wextra",
            "-Wno-unknown-pragmas", f"-DGP_KERNEL_SOURCE=\"{SOURCE_PATH}\"",
            str(HERE / "cuda_host_harness.cpp"), "-o", str(lib),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return lib


_CTYPES = {
    np.int32: ctypes.c_int32,
    np.int64: ctypes.c_int64,
    np.uint64: ctypes.c_uint64,
    np.float32: ctypes.c_float,
}


class HostEmulationRunner:
    """A KernelRunner that runs the launches on CPU tensors through the host-emulated source."""

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.lib.emu_launch.restype = ctypes.c_char_p
        self.lib.emu_launch.argtypes = [
            ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.POINTER(ctypes.c_void_p),
        ]  # fmt: skip
        self.lib.emu_kv_bytes_read.restype = ctypes.c_longlong
        self.lib.emu_kv_bytes_read.argtypes = [ctypes.c_int]
        self.launches: list[Launch] = []

    def kv_bytes_read(self, reset: bool = True) -> int:
        """Bytes the kernels read from the K/V caches since the last reset (then resets)."""
        return int(self.lib.emu_kv_bytes_read(int(reset)))

    def check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.device.type != "cpu":
            raise BackendError(
                f"{what} is on {tensor.device}; the host emulation takes CPU tensors"
            )

    def run(self, launches: Sequence[Launch]) -> None:
        for launch in launches:
            self.launches.append(launch)
            values = []
            for arg in launch.args:
                if isinstance(arg, torch.Tensor):
                    values.append(ctypes.c_void_p(arg.data_ptr()))
                else:
                    values.append(_CTYPES[type(arg)](arg.item()))
            params = (ctypes.c_void_p * len(values))(
                *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
            )
            err = self.lib.emu_launch(launch.kernel.encode(), *launch.grid, launch.block[0], params)
            if err:
                raise RuntimeError(f"{launch.kernel}: {err.decode()}")
