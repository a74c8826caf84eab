"""Run a CUDA listing on a GPU with CuPy: cuBLAS GEMMs, NCCL collectives, NVRTC-compiled kernels.

The same listing the CPU executor runs (`cpu_executor`), over two device allocations (the
state region and the arena) at the planned offsets. CuPy is imported only here, when a
listing first runs on a GPU; it is an optional dependency (`pip install 'graphpar[cuda]'`).

NCCL communicators, one per mesh-axis group the listing names (`comm=axes1`) and one for the
world (send/recv between stages), are made by `nccl_communicators`, which exchanges each
group's unique id through a key-value store (torch.distributed's `TCPStore`, as torchrun
gives every rank).

NumPy, and so CuPy, has no bfloat16: device memory of a bf16 tensor is viewed as its raw
16-bit pattern (int16) and reinterpreted as torch.bfloat16 on the way out (`array_dtype`,
`host_array`, `from_storage`); cuBLAS and NCCL are given their own bf16 type. These helpers,
the NCCL type and reduction choices and the bf16 division of an average's fallback, need no
CuPy: the CPU tests check them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from graphpar.backends.cuda.codegen import kernel_arguments, launch_shape, module_source
from graphpar.backends.cuda.cpu_executor import run_paged_call
from graphpar.errors import BackendError
from graphpar.ir.cuda_listing import Addr, Call, Listing
from graphpar.ir.mesh import Mesh
from graphpar.ir.registry import dtype as torch_dtype
from graphpar.ir.types import DTYPE_NAMES

__all__ = [
    "GpuListingExecutor",
    "array_dtype",
    "cuda_data_type",
    "divide_in_place",
    "from_storage",
    "host_array",
    "nccl_communicators",
    "nccl_datatype",
    "nccl_reduce_op",
]


class KeyValueStore(Protocol):
    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise BackendError("running a listing on a GPU needs CuPy (pip install "
                           "'graphpar[cuda]', or cupy-cuda12x)") from exc
    return cupy


# ------------------------------------------------------------------------- dtypes (no CuPy)

_ARRAY_DTYPES: dict[str, type] = {
    "f32": np.float32, "f64": np.float64, "f16": np.float16,
    "bf16": np.int16,  # no bfloat16 in NumPy / CuPy: its bit pattern
    "i64": np.int64, "i32": np.int32, "i16": np.int16, "i8": np.int8, "u8": np.uint8,
    "bool": np.bool_, "c64": np.complex64,
}
_BIT_PATTERN = {"bf16": torch.int16}  # IR dtype -> the torch dtype of its array dtype


def array_dtype(name: str) -> np.dtype:
    """The NumPy / CuPy dtype that device memory of IR dtype `name` is viewed as (bf16: int16,
    its raw bits)."""
    try:
        return np.dtype(_ARRAY_DTYPES[name])
    except KeyError:
        raise BackendError(f"the GPU executor has no array type for dtype {name!r}; dtypes: "
                           f"{', '.join(_ARRAY_DTYPES)}") from None


def host_array(t: torch.Tensor) -> np.ndarray:
    """`t` as a contiguous NumPy array on the host, of the array dtype of its IR dtype (a bf16
    tensor: the same bits as int16)."""
    t = t.detach().cpu().contiguous()
    bits = _BIT_PATTERN.get(DTYPE_NAMES.get(t.dtype, ""))
    return (t.view(bits) if bits is not None else t).numpy()


def from_storage(t: torch.Tensor, name: str) -> torch.Tensor:
    """A tensor read as `array_dtype(name)` (from NumPy or DLPack) as IR dtype `name`: the
    same memory, a bf16 tensor from its int16 bits."""
    if name in _BIT_PATTERN:
        return t.view(torch_dtype(name))
    return t


# cudaDataType values (library_types.h): CuPy's runtime module names some of them (not bf16)
_CUDA_DATA_TYPES = {"f32": ("CUDA_R_32F", 0), "f64": ("CUDA_R_64F", 1),
                    "f16": ("CUDA_R_16F", 2), "bf16": ("CUDA_R_16BF", 14)}


def cuda_data_type(runtime: Any, name: str) -> int:
    """cuBLAS's cudaDataType for IR dtype `name`: `runtime`'s constant (cupy.cuda.runtime),
    else the value from CUDA's headers (CuPy has no CUDA_R_16BF)."""
    try:
        constant, value = _CUDA_DATA_TYPES[name]
    except KeyError:
        raise BackendError(f"cuBLAS GEMMs take {', '.join(_CUDA_DATA_TYPES)}, not {name}"
                           ) from None
    return getattr(runtime, constant, value)


_NCCL_TYPES = {"f32": "NCCL_FLOAT32", "f64": "NCCL_FLOAT64", "f16": "NCCL_FLOAT16",
               "bf16": "NCCL_BFLOAT16", "i64": "NCCL_INT64", "i32": "NCCL_INT32",
               "i8": "NCCL_INT8", "u8": "NCCL_UINT8", "bool": "NCCL_UINT8"}
_NCCL_OPS = {"sum": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN", "avg": "NCCL_AVG"}
_NCCL_AVG_VERSION = 21000  # ncclAvg: NCCL 2.10


def nccl_datatype(nccl: Any, name: str, reduce_op: str | None = None) -> tuple[int, int]:
    """(NCCL datatype, NCCL elements per element) for `name` elements that NCCL moves
    (`reduce_op` None: all-gather, send, receive) or reduces with `reduce_op`. What NCCL (or
    this CuPy's `nccl` module) has no type for is moved as its bytes; c64 sums as float32
    pairs; other reductions of it are an error that says so."""
    constant = getattr(nccl, _NCCL_TYPES[name], None) if name in _NCCL_TYPES else None
    if constant is not None:
        return constant, 1
    if name == "c64" and reduce_op in ("sum", "avg"):  # (re, im) pairs add componentwise
        return nccl.NCCL_FLOAT32, 2
    if reduce_op is None:
        return nccl.NCCL_UINT8, array_dtype(name).itemsize
    raise BackendError(f"NCCL cannot {reduce_op}-reduce {name} tensors here"
                       + (" (this CuPy's cupy.cuda.nccl has no NCCL_BFLOAT16: install a newer "
                          "CuPy, or compute the reduction in f32)" if name == "bf16" else
                          "; compute the reduction in a type NCCL has (f32, f64, i32, i64)"))


def nccl_reduce_op(nccl: Any, op: str) -> tuple[int, bool]:
    """(NCCL reduction, whether the result must then be divided by the group size). An
    average is NCCL_AVG where NCCL has it (2.10 and later, and CuPy names it), else a sum
    that the caller divides."""
    if op not in _NCCL_OPS:
        raise BackendError(f"NCCL reductions are {', '.join(_NCCL_OPS)}, not {op!r}")
    constant = getattr(nccl, _NCCL_OPS[op], None)
    if op == "avg":
        version = getattr(nccl, "get_version", None)
        if constant is None or (version is not None and version() < _NCCL_AVG_VERSION):
            return nccl.NCCL_SUM, True
    if constant is None:
        raise BackendError(f"this CuPy's cupy.cuda.nccl has no {_NCCL_OPS[op]}")
    return constant, False


def divide_in_place(xp: Any, x: Any, n: int, name: str) -> None:
    """`x /= n` for an array of IR dtype `name` viewed as `array_dtype(name)`, with `xp` the
    array module (CuPy on the GPU, NumPy in tests). bf16 (int16 bits) is divided in float32
    and rounded to nearest even, as torch rounds float32 to bfloat16."""
    if name == "bf16":
        wide = x.view(xp.uint16).astype(xp.uint32) << 16
        quotient = wide.view(xp.float32) / xp.float32(n)
        bits = quotient.view(xp.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        x[...] = xp.where(xp.isnan(quotient), 0x7FC0, rounded).astype(xp.uint16).view(xp.int16)
    elif name in ("f32", "f64", "f16", "c64"):
        x /= n
    else:
        raise BackendError(f"an average of {name} tensors: only floating-point ones have one")


def nccl_communicators(listing: Listing, mesh: Mesh, rank: int, store: KeyValueStore
                       ) -> dict[str, Any]:
    """One NcclCommunicator per group the listing's NCCL calls name, by name ("axes0_1",
    "world"); every rank must call it (group member 0 makes each unique id)."""
    cupy = _cupy()
    from cupy.cuda import nccl

    device = mesh.device_ids[rank]
    names = sorted({c["comm"] for c in listing.calls if c.kind.startswith("nccl.")
                    and c.get("comm") is not None})
    comms = {}
    for name in names:
        if name == "world":
            group = tuple(mesh.device_ids)
        else:
            group = mesh.group_of(device, tuple(int(a) for a in name[4:].split("_")))
        key = f"graphpar/nccl/{name}/{'-'.join(map(str, group))}"
        position = group.index(device)
        if position == 0:
            store.set(key, json.dumps(list(nccl.get_unique_id())))
        unique_id = tuple(json.loads(store.get(key)))
        with cupy.cuda.Device(torch.cuda.current_device() if torch.cuda.is_available() else 0):
            comms[name] = nccl.NcclCommunicator(len(group), unique_id, position)
    return comms


class GpuListingExecutor:
    """`listing` on the current GPU: kernels compiled once (NVRTC), memory allocated once,
    `run(inputs)` as often as wanted. `comms`: from `nccl_communicators`, when it
    communicates."""

    def __init__(self, listing: Listing, comms: Mapping[str, Any] | None = None) -> None:
        cupy = _cupy()
        from cupy.cuda import cublas

        self.cupy, self.cublas = cupy, cublas
        self.listing = listing
        self.comms = dict(comms or {})
        self.stream = cupy.cuda.get_current_stream()
        self.regions = {"arena": cupy.empty(max(listing.arena_bytes, 1), dtype=cupy.uint8),
                        "state": cupy.zeros(max(listing.state_bytes, 1), dtype=cupy.uint8)}
        names = listing.kernels()
        self.module = cupy.RawModule(code=module_source(listing),
                                     options=("-std=c++17",)) if names else None
        self.kernels = {name: self.module.get_function(name) for name in names}
        self.handle = cupy.cuda.device.get_cublas_handle()
        self._nccl_module: Any = None  # cupy.cuda.nccl, imported by the first NCCL call
        self._grouped = False  # between nccl.groupStart and nccl.groupEnd
        self._after_group: list[Callable[[], None]] = []

    @property
    def nccl(self) -> Any:
        if self._nccl_module is None:
            from cupy.cuda import nccl

            self._nccl_module = nccl
        return self._nccl_module

    # --- memory ------------------------------------------------------------------------------

    def ptr(self, addr: Addr) -> int:
        return self.regions[addr.region].data.ptr + addr.offset

    def _view(self, addr: Addr, dtype: str, shape: Sequence[int], strides: Sequence[int]):
        """A CuPy view of device memory, of `array_dtype(dtype)` (bf16: its int16 bits)."""
        dt = array_dtype(dtype)
        flat = self.regions[addr.region][addr.offset:].view(dt)  # regions: 256-byte multiples
        return self.cupy.lib.stride_tricks.as_strided(
            flat, tuple(shape), tuple(s * dt.itemsize for s in strides))

    def run(self, inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
            ) -> list[torch.Tensor]:
        listing, cupy = self.listing, self.cupy
        if not isinstance(inputs, Mapping):
            inputs = {ref.name: t for ref, t in zip(listing.inputs, inputs)}
        for ref in listing.inputs:
            self._view(ref.addr, ref.dtype, ref.shape, ref.strides)[...] = cupy.asarray(
                host_array(inputs[ref.name]))
        for index, call in enumerate(listing.calls):
            try:
                self.execute(call)
            except Exception as exc:
                raise BackendError(f"listing @{listing.name} rank {listing.rank}, call {index} "
                                   f"{call.kind} ({call.note}): {exc}") from exc
        self.stream.synchronize()
        return [from_storage(torch.from_numpy(cupy.asnumpy(
                    self._view(r.addr, r.dtype, r.shape, r.strides))), r.dtype)
                for r in listing.outputs]

    # --- calls -------------------------------------------------------------------------------

    def execute(self, call: Call) -> None:
        kind = call.kind
        if kind.startswith("kernel."):
            blocks, threads = launch_shape(call)
            args = tuple(np.uint64(self.ptr(call[name])) for name in kernel_arguments(call))
            self.kernels[call["name"]]((blocks,), (threads,), args, stream=self.stream)
        elif kind == "cublas.gemmEx":
            self._gemm(call, batched=False)
        elif kind == "cublas.gemmStridedBatchedEx":
            self._gemm(call, batched=True)
        elif kind == "cuda.memsetAsync":
            self.cupy.cuda.runtime.memsetAsync(self.ptr(call["dst"]), call["value"],
                                               call["count"], self.stream.ptr)
        elif kind == "cuda.memcpyAsync":
            self.cupy.cuda.runtime.memcpyAsync(
                self.ptr(call["dst"]), self.ptr(call["src"]), call["count"],
                self.cupy.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
        elif kind.startswith("nccl."):
            self._nccl(call)
        elif kind.startswith("paged."):  # the existing paged-attention CUDA kernels
            from graphpar.backends.cuda.paged_attention import default_kernels

            run_paged_call(self, call, default_kernels())
        else:
            raise BackendError(f"the GPU executor has no call {kind!r}")

    def tensor(self, addr: Addr, dtype: str, shape: Sequence[int], strides: Sequence[int]
               ) -> torch.Tensor:
        """A torch view of device memory (for the paged-attention kernels' wrapper)."""
        return from_storage(torch.from_dlpack(self._view(addr, dtype, shape, strides)), dtype)

    def _gemm(self, c: Call, batched: bool) -> None:
        cublas, runtime = self.cublas, self.cupy.cuda.runtime
        compute = getattr(cublas, c["computeType"], None)
        if compute is None:
            compute = _CUBLAS_COMPUTE[c["computeType"]]
        scalar = np.float64 if c["computeType"] == "CUBLAS_COMPUTE_64F" else np.float32
        alpha, beta = np.array(c["alpha"], dtype=scalar), np.array(c["beta"], dtype=scalar)
        op = {"N": cublas.CUBLAS_OP_N, "T": cublas.CUBLAS_OP_T}
        types = [cuda_data_type(runtime, c[k]) for k in ("Atype", "Btype", "Ctype")]
        cublas.setStream(self.handle, self.stream.ptr)
        head = (self.handle, op[c["transa"]], op[c["transb"]], c["m"], c["n"], c["k"],
                alpha.ctypes.data)
        if batched:
            cublas.gemmStridedBatchedEx(
                *head, self.ptr(c["A"]), types[0], c["lda"], c["strideA"],
                self.ptr(c["B"]), types[1], c["ldb"], c["strideB"], beta.ctypes.data,
                self.ptr(c["C"]), types[2], c["ldc"], c["strideC"], c["batchCount"], compute,
                cublas.CUBLAS_GEMM_DEFAULT)
        else:
            cublas.gemmEx(*head, self.ptr(c["A"]), types[0], c["lda"], self.ptr(c["B"]),
                          types[1], c["ldb"], beta.ctypes.data, self.ptr(c["C"]), types[2],
                          c["ldc"], compute, cublas.CUBLAS_GEMM_DEFAULT)

    def _nccl(self, c: Call) -> None:
        nccl, kind = self.nccl, c.kind
        if kind == "nccl.groupStart":
            nccl.groupStart()
            self._grouped = True
            return
        if kind == "nccl.groupEnd":
            nccl.groupEnd()
            self._grouped = False
            pending, self._after_group = self._after_group, []
            for step in pending:  # after the group's calls, which run at its end
                step()
            return
        comm = self.comms.get(c["comm"])
        if comm is None:
            raise BackendError(f"{kind} needs the NCCL communicator {c['comm']!r} "
                               "(see nccl_communicators)")
        stream = self.stream.ptr
        if kind in ("nccl.allReduce", "nccl.reduceScatter"):
            op, divide = nccl_reduce_op(nccl, c["op"])
            dtype, per = nccl_datatype(nccl, c["datatype"], c["op"])
            count = c["count" if kind == "nccl.allReduce" else "recvcount"]
            send, recv = self.ptr(c["sendbuff"]), self.ptr(c["recvbuff"])
            if kind == "nccl.allReduce":
                comm.allReduce(send, recv, count * per, dtype, op, stream)
            else:
                comm.reduceScatter(send, recv, count * per, dtype, op, stream)
            if divide:  # no NCCL_AVG: the sum, divided by the group size
                self._then(lambda: self._divide(c["recvbuff"], c["datatype"], count,
                                                comm.size()))
            return
        dtype, per = nccl_datatype(nccl, c["datatype"])
        if kind == "nccl.allGather":
            comm.allGather(self.ptr(c["sendbuff"]), self.ptr(c["recvbuff"]),
                           c["sendcount"] * per, dtype, stream)
        elif kind == "nccl.send":
            comm.send(self.ptr(c["sendbuff"]), c["count"] * per, dtype, c["peer"], stream)
        elif kind == "nccl.recv":
            comm.recv(self.ptr(c["recvbuff"]), c["count"] * per, dtype, c["peer"], stream)
        else:
            raise BackendError(f"the GPU executor has no NCCL call {kind!r}")

    def _then(self, step: Callable[[], None]) -> None:
        """Run `step` after the NCCL call just issued: now, or after its group's end."""
        if self._grouped:
            self._after_group.append(step)
        else:
            step()

    def _divide(self, addr: Addr, dtype: str, count: int, n: int) -> None:
        with self.stream:  # ordered after the collective on the executor's stream
            divide_in_place(self.cupy, self._view(addr, dtype, (count,), (1,)), n, dtype)


_CUBLAS_COMPUTE = {"CUBLAS_COMPUTE_32F": 68, "CUBLAS_COMPUTE_64F": 70}  # cublas_api.h
