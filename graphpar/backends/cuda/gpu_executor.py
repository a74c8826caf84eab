"""Run a CUDA listing on a GPU with CuPy: cuBLAS GEMMs, NCCL collectives, NVRTC-compiled kernels.

The same listing the CPU executor runs (`cpu_executor`), over two device allocations (the
state region and the arena) at the planned offsets. CuPy is imported only here, when a
listing first runs on a GPU; it is an optional dependency (`pip install 'graphpar[cuda]'`).

NCCL communicators, one per mesh-axis group the listing names (`comm=axes1`) and one for the
world (send/recv between stages), are made by `nccl_communicators`, which exchanges each
group's unique id through a key-value store (torch.distributed's `TCPStore`, as torchrun
gives every rank).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from graphpar.backends.cuda.codegen import kernel_arguments, launch_shape, module_source
from graphpar.backends.cuda.cpu_executor import run_paged_call
from graphpar.errors import BackendError
from graphpar.ir.cuda_listing import Addr, Call, Listing
from graphpar.ir.mesh import Mesh

__all__ = ["GpuListingExecutor", "nccl_communicators"]


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

    # --- memory ------------------------------------------------------------------------------

    def ptr(self, addr: Addr) -> int:
        return self.regions[addr.region].data.ptr + addr.offset

    def _view(self, addr: Addr, dtype: str, shape: Sequence[int], strides: Sequence[int]):
        from graphpar.ir.registry import dtype as torch_dtype

        dt = torch.empty((), dtype=torch_dtype(dtype)).numpy().dtype
        flat = self.regions[addr.region][addr.offset:].view(dt)  # regions: 256-byte multiples
        return self.cupy.lib.stride_tricks.as_strided(
            flat, tuple(shape), tuple(s * dt.itemsize for s in strides))

    def run(self, inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
            ) -> list[torch.Tensor]:
        listing, cupy = self.listing, self.cupy
        if not isinstance(inputs, Mapping):
            inputs = {ref.name: t for ref, t in zip(listing.inputs, inputs)}
        for ref in listing.inputs:
            host = inputs[ref.name].detach().cpu().contiguous()
            self._view(ref.addr, ref.dtype, ref.shape, ref.strides)[...] = cupy.asarray(
                host.numpy())
        for index, call in enumerate(listing.calls):
            try:
                self.execute(call)
            except Exception as exc:
                raise BackendError(f"listing @{listing.name} rank {listing.rank}, call {index} "
                                   f"{call.kind} ({call.note}): {exc}") from exc
        self.stream.synchronize()
        return [torch.from_numpy(cupy.asnumpy(self._view(r.addr, r.dtype, r.shape, r.strides)))
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
        return torch.from_dlpack(self._view(addr, dtype, shape, strides))

    _DATA = {"f32": "CUDA_R_32F", "f64": "CUDA_R_64F", "f16": "CUDA_R_16F",
             "bf16": "CUDA_R_16BF"}

    def _gemm(self, c: Call, batched: bool) -> None:
        cublas, runtime = self.cublas, self.cupy.cuda.runtime
        compute = getattr(cublas, c["computeType"])
        scalar = np.float64 if c["computeType"] == "CUBLAS_COMPUTE_64F" else np.float32
        alpha, beta = np.array(c["alpha"], dtype=scalar), np.array(c["beta"], dtype=scalar)
        op = {"N": cublas.CUBLAS_OP_N, "T": cublas.CUBLAS_OP_T}
        types = [getattr(runtime, self._DATA[c[k]]) for k in ("Atype", "Btype", "Ctype")]
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
        from cupy.cuda import nccl

        kind = c.kind
        if kind == "nccl.groupStart":
            nccl.groupStart()
            return
        if kind == "nccl.groupEnd":
            nccl.groupEnd()
            return
        comm = self.comms.get(c["comm"])
        if comm is None:
            raise BackendError(f"{kind} needs the NCCL communicator {c['comm']!r} "
                               "(see nccl_communicators)")
        dtype = {"f32": nccl.NCCL_FLOAT32, "f64": nccl.NCCL_FLOAT64, "f16": nccl.NCCL_FLOAT16,
                 "i64": nccl.NCCL_INT64, "i32": nccl.NCCL_INT32, "u8": nccl.NCCL_UINT8,
                 "bool": nccl.NCCL_UINT8}[c["datatype"]]
        ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN,
               "avg": getattr(nccl, "NCCL_AVG", None)}
        stream = self.stream.ptr
        if kind == "nccl.allReduce":
            comm.allReduce(self.ptr(c["sendbuff"]), self.ptr(c["recvbuff"]), c["count"], dtype,
                           ops[c["op"]], stream)
        elif kind == "nccl.allGather":
            comm.allGather(self.ptr(c["sendbuff"]), self.ptr(c["recvbuff"]), c["sendcount"],
                           dtype, stream)
        elif kind == "nccl.reduceScatter":
            comm.reduceScatter(self.ptr(c["sendbuff"]), self.ptr(c["recvbuff"]),
                               c["recvcount"], dtype, ops[c["op"]], stream)
        elif kind == "nccl.send":
            comm.send(self.ptr(c["sendbuff"]), c["count"], dtype, c["peer"], stream)
        elif kind == "nccl.recv":
            comm.recv(self.ptr(c["recvbuff"]), c["count"], dtype, c["peer"], stream)
        else:
            raise BackendError(f"the GPU executor has no NCCL call {kind!r}")
