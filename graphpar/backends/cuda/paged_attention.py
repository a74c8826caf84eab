"""Launcher for the paged-attention CUDA kernels: the CPU reference's API on torch CUDA tensors.

The kernels live in ``paged_attention.cu`` next to this file; the KV-cache layout is the one
documented in :mod:`graphpar.ir.paged_reference`. CuPy compiles the source once per
device with NVRTC (``cupy.RawModule``; CuPy also caches the binary on disk) and launches the
``extern "C"`` entry points on torch's current stream, passing raw device pointers, so torch
tensors of any dtype (bf16 included, which CuPy has no dtype for) go straight in.

Building the list of launches (:class:`Launch`) is separate from running it (a
:class:`KernelRunner`), so the same argument packing runs on a GPU through CuPy and, in tests,
through a host emulation of the kernel source.

Bounds: block-table entries, context lengths against the table's width and cache slots are
checked when the metadata is on the host (free), or on the device when ``check=True`` or
``GRAPHPAR_CHECK_KERNEL_ARGS=1`` (that costs a device sync). The decode path never reads a
device value otherwise: pass ``max_context_len`` (any upper bound; too small only costs speed).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from graphpar.errors import BackendError, GenerationError
from graphpar.ir import paged_reference as reference_paged
from graphpar.ir.paged_reference import SUPPORTED_HEAD_SIZES, BlockCopies

__all__ = [
    "ACC_PER_BLOCK",
    "NUM_THREADS",
    "PARTITION_SIZE",
    "SOURCE_PATH",
    "CupyRunner",
    "KernelRunner",
    "Launch",
    "PagedAttentionKernels",
    "default_kernels",
    "head_chunks",
    "kernel_names",
]

SOURCE_PATH = Path(__file__).with_name("paged_attention.cu")
NUM_THREADS = 128  # gp::kNumThreads in the .cu
#: Query heads times head size one attention block accumulates (gp::max_heads_per_block).
ACC_PER_BLOCK = NUM_THREADS * 16
#: Tokens per split-K partition; contexts longer than this use the split-K kernels.
PARTITION_SIZE = 512
COPY_THREADS = 256
MAX_GRID_Y = 65535

_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
NULL = np.uint64(0)


def head_chunks(num_heads: int, num_kv_heads: int, head_size: int) -> tuple[int, int]:
    """(blocks per kv head, query heads per block) of a decode launch: one block computes all
    ``num_heads // num_kv_heads`` query heads of its kv head, so K/V is read once per kv head;
    a group over ``ACC_PER_BLOCK // head_size`` heads is split into as few, as even chunks as fit
    (each chunk reads its kv head's K/V once)."""
    group = num_heads // num_kv_heads
    chunks = -(-group // (ACC_PER_BLOCK // head_size))
    return chunks, -(-group // chunks)


def kernel_names() -> list[str]:
    """Every ``extern "C"`` entry point in ``paged_attention.cu``."""
    names = [
        f"paged_attention_{dt}_h{d}" for dt in _DTYPE_NAMES.values() for d in SUPPORTED_HEAD_SIZES
    ]
    names += [f"paged_attention_reduce_{dt}" for dt in _DTYPE_NAMES.values()]
    return names + ["reshape_and_cache", "copy_blocks"]


@dataclass(frozen=True)
class Launch:
    """One kernel launch: entry point, grid, block, and arguments in the kernel's order.

    Arguments are torch tensors (passed as device pointers), ``NULL``, or numpy scalars whose
    type is the C parameter type (``np.int32`` for ``int``, ``np.float32`` for ``float``,
    ``np.int64`` for ``long long``).
    """

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[Any, ...]


class KernelRunner(Protocol):
    """Runs launches on some device; checks that tensors live there."""

    def check_tensor(self, tensor: torch.Tensor, what: str) -> None: ...

    def run(self, launches: Sequence[Launch]) -> None: ...


def _cuda_include_dirs() -> list[str]:
    """CUDA include folders holding cuda_fp16.h / cuda_bf16.h, for NVRTC."""
    candidates = [os.environ.get(var, "") for var in ("CUDA_PATH", "CUDA_HOME", "CUDA_ROOT")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    try:  # pip wheels: nvidia-cuda-runtime-cu12 ships the headers
        import nvidia.cuda_runtime  # type: ignore[import-not-found]

        candidates.extend(str(Path(p)) for p in nvidia.cuda_runtime.__path__)
    except ImportError:
        pass
    dirs: list[str] = []
    for root in candidates:
        include = Path(root) / "include" if root else None
        if include and (include / "cuda_fp16.h").is_file() and str(include) not in dirs:
            dirs.append(str(include))
    return dirs


class CupyRunner:
    """Compiles ``paged_attention.cu`` with CuPy, once per device; launches on torch's stream."""

    def __init__(self, source_path: Path = SOURCE_PATH) -> None:
        self.source_path = source_path
        self._modules: dict[int, Any] = {}
        self._functions: dict[tuple[int, str], Any] = {}

    @staticmethod
    def _cupy() -> Any:
        try:
            import cupy
        except ImportError as exc:
            raise BackendError(
                "the paged-attention CUDA kernels need CuPy, which is not installed: "
                "pip install 'graphpar[cuda]' (cupy-cuda12x), or use the CPU reference "
                "graphpar.ir.paged_reference"
            ) from exc
        if not torch.cuda.is_available():
            raise BackendError(
                "the paged-attention CUDA kernels need a CUDA GPU and torch sees none; "
                "use the CPU reference graphpar.ir.paged_reference"
            )
        return cupy

    def check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        if not tensor.is_cuda:
            raise BackendError(
                f"{what} is on {tensor.device}; the CUDA kernels take CUDA tensors "
                "(use graphpar.ir.paged_reference for CPU tensors)"
            )

    def module(self, device: int) -> Any:
        """The compiled RawModule for one device (compiled on first use)."""
        if device in self._modules:
            return self._modules[device]
        cupy = self._cupy()
        code = self.source_path.read_text()
        base = ("--std=c++17",)
        includes = tuple(f"-I{d}" for d in _cuda_include_dirs())
        # NVRTC first with its built-in headers, then with the toolkit's (a toolkit newer than
        # NVRTC can ship headers NVRTC rejects), then nvcc if there is one.
        attempts = [("nvrtc", base)]
        if includes:
            attempts.append(("nvrtc", base + includes))
        if shutil.which("nvcc"):
            attempts.append(("nvcc", base))
        errors = []
        with cupy.cuda.Device(device):
            for backend, options in attempts:
                try:
                    module = cupy.RawModule(code=code, options=options, backend=backend)
                    module.get_function(kernel_names()[0])  # compiles now, not mid-step
                except Exception as exc:  # CompileException, or a missing nvrtc library
                    errors.append(f"{backend} {' '.join(options)}: {exc}")
                    continue
                self._modules[device] = module
                return module
        raise BackendError(f"could not compile {self.source_path.name}:\n" + "\n".join(errors))

    def run(self, launches: Sequence[Launch]) -> None:
        cupy = self._cupy()
        tensors = [a for launch in launches for a in launch.args if isinstance(a, torch.Tensor)]
        device = tensors[0].device.index if tensors else torch.cuda.current_device()
        module = self.module(device)
        stream = torch.cuda.current_stream(device)
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream.cuda_stream):
            for launch in launches:
                args = tuple(
                    np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a
                    for a in launch.args
                )
                key = (device, launch.kernel)
                if key not in self._functions:
                    self._functions[key] = module.get_function(launch.kernel)
                self._functions[key](launch.grid, launch.block, args)


def _check_head_size(head_size: int) -> None:
    if head_size not in SUPPORTED_HEAD_SIZES:
        supported = ", ".join(map(str, SUPPORTED_HEAD_SIZES))
        raise GenerationError(
            f"head size {head_size} is not supported by the paged-attention CUDA kernels; "
            f"supported head sizes: {supported}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise BackendError(
            f"the paged-attention CUDA kernels take float32, float16 or bfloat16, not {dtype}"
        ) from None


def _check_aligned(tensor: torch.Tensor, what: str) -> None:
    if tensor.data_ptr() % 16:
        raise BackendError(f"{what} must start on a 16-byte boundary for vectorised loads")


def _index_tensor(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return tensor.to(device=device, dtype=dtype).contiguous()


def _should_check(check: bool | None, *tensors: torch.Tensor) -> bool:
    """Check values when asked, or when every tensor is on the host (no device sync)."""
    if check is not None:
        return check
    if os.environ.get("GRAPHPAR_CHECK_KERNEL_ARGS", "") not in ("", "0"):
        return True
    return all(t.device.type == "cpu" for t in tensors)


def check_decode_metadata(block_tables: torch.Tensor, context_lens: torch.Tensor,
                          num_blocks: int, block_size: int,
                          max_context_len: int | None = None) -> None:
    """Raise ValueError for a context longer than its table row, a used table entry outside
    the pool, or a ``max_context_len`` below a context length (values are read: host tensors)."""
    lens = context_lens.long()
    width = block_tables.shape[1]
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > width * block_size):
        bad = int(((lens < 0) | (lens > width * block_size)).nonzero()[0])
        raise ValueError(f"context_lens[{bad}] = {int(lens[bad])} does not fit a block table of "
                         f"{width} blocks of {block_size} tokens")
    if max_context_len is not None and lens.numel() and int(lens.max()) > max_context_len:
        raise ValueError(f"max_context_len={max_context_len} is below context length "
                         f"{int(lens.max())}")
    used = torch.arange(width)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    entries = block_tables.long()[used]
    if entries.numel() and (int(entries.min()) < 0 or int(entries.max()) >= num_blocks):
        seq, col = (used & ((block_tables.long() < 0) | (block_tables.long() >= num_blocks))
                    ).nonzero()[0].tolist()
        raise ValueError(f"block_tables[{seq}, {col}] = {int(block_tables[seq, col])} is not a "
                         f"block of the cache (0..{num_blocks - 1})")


def check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError for a slot outside ``-1 .. num_slots - 1`` (-1 skips a token)."""
    slots = slot_mapping.long()
    bad = ((slots < -1) | (slots >= num_slots)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"slot_mapping[{i}] = {int(slots[i])} is outside the cache's "
                         f"{num_slots} slots (-1 skips a token)")


class PagedAttentionKernels:
    """The paged-attention operations (a :class:`graphpar.backends.paged.PagedKernels`), run by
    a :class:`KernelRunner` (CuPy by default)."""

    def __init__(self, runner: KernelRunner | None = None) -> None:
        self.runner: KernelRunner = runner if runner is not None else CupyRunner()

    def _check_caches(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        reference_paged.check_kv_caches(key_cache, value_cache)
        for cache, what in ((key_cache, "key_cache"), (value_cache, "value_cache")):
            self.runner.check_tensor(cache, what)
            if not cache.is_contiguous():
                raise BackendError(f"{what} must be contiguous")
            _check_aligned(cache, what)
        _dtype_name(key_cache.dtype)
        _check_head_size(key_cache.shape[3])

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        check: bool | None = None,
    ) -> None:
        """Kernel version of :func:`graphpar.ir.paged_reference.reshape_and_cache`
        (``check``: see the module docstring)."""
        self._check_caches(key_cache, value_cache)
        reference_paged.check_cache_write(key, value, key_cache, value_cache, slot_mapping)
        _, _, num_kv_heads, head_size = key_cache.shape
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        if _should_check(check, slot_mapping):
            check_slots(slot_mapping, key_cache.shape[0] * key_cache.shape[1])
        vec_elems = 16 // key.element_size()
        token_vecs = num_kv_heads * head_size // vec_elems
        strides = []
        tensors = []
        for t, what in ((key, "key"), (value, "value")):
            self.runner.check_tensor(t, what)
            # Rows may be strided (a view into a fused qkv tensor) but each token's
            # [num_kv_heads, head_size] block must be dense and 16-byte aligned.
            dense = t.stride(2) == 1 and t.stride(1) == head_size
            if not dense or t.stride(0) % vec_elems or t.data_ptr() % 16:
                t = t.contiguous()
            tensors.append(t)
            strides.append(np.int64(t.stride(0) // vec_elems))
        slots = _index_tensor(slot_mapping, torch.int64, key_cache.device)
        launch = Launch(
            "reshape_and_cache",
            (num_tokens, 1, 1),
            (min(NUM_THREADS, max(32, -(-token_vecs // 32) * 32)), 1, 1),
            (
                tensors[0],
                tensors[1],
                key_cache,
                value_cache,
                slots,
                strides[0],
                strides[1],
                np.int32(token_vecs),
            ),
        )
        self.runner.run([launch])

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        max_context_len: int | None = None,
        use_split: bool | None = None,
        partition_size: int = PARTITION_SIZE,
        out: torch.Tensor | None = None,
        check: bool | None = None,
    ) -> torch.Tensor:
        """Kernel version of :func:`graphpar.ir.paged_reference.paged_attention`.

        ``max_context_len`` bounds ``context_lens`` (pass it to avoid a device sync; one below
        a context length is an error when checked, and otherwise only slower: the last
        partition takes the tail). Split-K runs when ``use_split`` says so, or by default when
        ``max_context_len > partition_size``. ``check``: see the module docstring.
        """
        self._check_caches(key_cache, value_cache)
        reference_paged.check_decode_query(query, key_cache, num_kv_heads)
        if query.dtype != key_cache.dtype:
            raise ValueError(
                f"query dtype {query.dtype} differs from cache dtype {key_cache.dtype}"
            )
        num_seqs, num_heads, head_size = query.shape
        _, block_size, cache_kv_heads, _ = key_cache.shape
        if num_seqs > MAX_GRID_Y:
            raise BackendError(f"at most {MAX_GRID_Y} sequences per launch, got {num_seqs}")
        if partition_size <= 0:
            raise ValueError(f"partition_size must be positive, got {partition_size}")
        self.runner.check_tensor(query, "query")
        device = query.device
        query = query.contiguous()
        _check_aligned(query, "query")
        if out is None:
            out = torch.empty_like(query)
        elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor of query's shape and dtype")
        if num_seqs == 0:
            return out
        if _should_check(check, block_tables, context_lens):
            check_decode_metadata(block_tables, context_lens, key_cache.shape[0], block_size,
                                  max_context_len)
        tables = _index_tensor(block_tables, torch.int32, device)
        lens = _index_tensor(context_lens, torch.int32, device)
        if max_context_len is None:
            max_context_len = int(lens.max())  # a device sync: callers should pass it
        if use_split is None:
            use_split = max_context_len > partition_size

        kernel = f"paged_attention_{_dtype_name(query.dtype)}_h{head_size}"
        chunks, per_block = head_chunks(num_heads, cache_kv_heads, head_size)
        common = (
            query, key_cache, value_cache, tables, lens, np.int32(num_heads),
            np.int32(cache_kv_heads), np.int32(per_block), np.int32(block_size),
            np.int32(tables.shape[1]), np.int32(query.stride(0)), np.float32(scale),
        )  # fmt: skip
        block = (NUM_THREADS, 1, 1)
        blocks_x = cache_kv_heads * chunks
        if not use_split:
            launch = Launch(
                kernel, (blocks_x, num_seqs, 1), block,
                (out, NULL, NULL, NULL, *common, np.int32(0), np.int32(1)),
            )  # fmt: skip
            self.runner.run([launch])
            return out

        parts = max(1, -(-max_context_len // partition_size))
        tmp_out = torch.empty(
            num_seqs, num_heads, parts, head_size, dtype=torch.float32, device=device
        )
        max_logits = torch.empty(num_seqs, num_heads, parts, dtype=torch.float32, device=device)
        exp_sums = torch.empty_like(max_logits)
        launches = [
            Launch(
                kernel, (blocks_x, num_seqs, parts), block,
                (out, tmp_out, max_logits, exp_sums, *common, np.int32(partition_size),
                 np.int32(parts)),
            ),
            Launch(
                f"paged_attention_reduce_{_dtype_name(query.dtype)}", (num_heads, num_seqs, 1),
                block,
                (out, tmp_out, max_logits, exp_sums, lens, np.int32(head_size),
                 np.int32(partition_size), np.int32(parts)),
            ),
        ]  # fmt: skip
        self.runner.run(launches)
        return out

    def paged_prefill_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        num_kv_heads: int | None = None,
    ) -> torch.Tensor:
        """Prefill attention: the torch reference run on the device's tensors.

        Prefill is compute-bound and uses a conventional attention (the paper uses
        FlashAttention); there is no dedicated CUDA kernel for it here.
        """
        self._check_caches(key_cache, value_cache)
        self.runner.check_tensor(query, "query")
        return reference_paged.paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            query_start_loc,
            scale,
            num_kv_heads,
        )

    def copy_blocks(
        self,
        caches: Sequence[torch.Tensor],
        src_to_dst: BlockCopies,
    ) -> None:
        """Kernel version of :func:`graphpar.ir.paged_reference.copy_blocks`: one launch."""
        pairs = reference_paged.block_copy_pairs(src_to_dst)
        if pairs.numel() == 0 or not caches:
            return
        if len(caches) > MAX_GRID_Y:
            raise BackendError(f"at most {MAX_GRID_Y} caches per copy_blocks call")
        device = caches[0].device
        block_vecs = []
        for i, cache in enumerate(caches):
            self.runner.check_tensor(cache, f"caches[{i}]")
            if cache.device != device or not cache.is_contiguous():
                raise BackendError("copy_blocks caches must be contiguous and on one device")
            _check_aligned(cache, f"caches[{i}]")
            block_bytes = cache[0].numel() * cache.element_size()
            if block_bytes % 16:
                raise BackendError(
                    f"caches[{i}] blocks are {block_bytes} bytes, not 16-byte vectors"
                )
            block_vecs.append(block_bytes // 16)
            if int(pairs.max()) >= cache.shape[0] or int(pairs.min()) < 0:
                raise ValueError(f"block id out of range for caches[{i}] ({cache.shape[0]} blocks)")
        pointers = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(device)
        vecs = torch.tensor(block_vecs, dtype=torch.int64).to(device)
        pairs = pairs.contiguous().to(device)
        launch = Launch(
            "copy_blocks", (pairs.shape[0], len(caches), 1), (COPY_THREADS, 1, 1),
            (pointers, vecs, pairs),
        )  # fmt: skip
        self.runner.run([launch])


_default: PagedAttentionKernels | None = None


def default_kernels() -> PagedAttentionKernels:
    """The kernels on the default CuPy runner, made on first use: what `kernel="cuda"` runs
    (`graphpar.backends.paged.paged_kernels`)."""
    global _default
    if _default is None:
        _default = PagedAttentionKernels()
    return _default
