"""Run a CUDA listing on the CPU, call for call, over byte arenas at the planned offsets.

Every call reads and writes typed strided views of two byte tensors (the state region and the
arena), exactly where the listing says: a GEMM runs as the column-major strided GEMM its
transa/transb/m/n/k/ld/stride parameters describe (so a wrong leading dimension reads the
wrong elements, or past the region and fails), a pointwise kernel computes its expression with
the op registry's torch references, NCCL calls go to a communicator
(graphpar.runtime.comm.Communicator: GlooCommunicator across processes).

The arena starts as NaN bytes, and with `poison=True` every buffer is overwritten with NaN
bytes after its last use: a plan that let two live buffers share bytes gives NaNs or wrong
numbers instead of passing by luck.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from graphpar.backends.cuda.cpu_index_kernels import run_index_kernel
from graphpar.errors import BackendError
from graphpar.ir import paged_reference
from graphpar.ir.cuda_listing import ALIGNMENT, Addr, Call, Const, Leaf, Listing, parse_expr
from graphpar.ir.paged_ops import paged_attention_with, reshape_and_cache_with
from graphpar.ir.registry import dtype as torch_dtype
from graphpar.ir.registry import get_op

__all__ = ["CpuListingExecutor", "ListingComm", "evaluate_expr", "run_paged_call"]

INDEX_KERNEL_KINDS = ("kernel.im2col", "kernel.col2im", "kernel.max_pool2d",
                      "kernel.max_pool2d_backward", "kernel.cumsum", "kernel.topk",
                      "kernel.scatter")

POISON = 0xFF  # every float made of these bytes is a NaN


class ListingComm(Protocol):
    """What the executor needs of a communicator (graphpar.runtime.comm.Communicator)."""

    def all_reduce(self, x: torch.Tensor, axes: Sequence[int], op: str = "sum"
                   ) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, axes: Sequence[int], dim: int) -> torch.Tensor: ...

    def reduce_scatter(self, x: torch.Tensor, axes: Sequence[int], dim: int, op: str = "sum"
                       ) -> torch.Tensor: ...

    def all_to_all(self, x: torch.Tensor, axes: Sequence[int], split_dim: int,
                   concat_dim: int) -> torch.Tensor: ...

    def send(self, x: torch.Tensor, dst: int, tag: int = 0) -> torch.Tensor: ...

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int = 0
             ) -> torch.Tensor: ...


def evaluate_expr(expr: Any, inputs: Sequence[torch.Tensor]) -> Any:
    """A pointwise kernel's expression on the CPU: each op is its registry reference."""
    if isinstance(expr, Leaf):
        return inputs[expr.index]
    if isinstance(expr, Const):
        return expr.value
    args = [evaluate_expr(a, inputs) for a in expr.args]
    if not any(isinstance(a, torch.Tensor) for a in args):  # all literals: one 0-d tensor
        args[0] = torch.tensor(args[0])
    return get_op(expr.op).reference(*args, **dict(expr.attrs))


class CpuListingExecutor:
    """`listing` ready to run on the CPU (with `comm`, this rank's communicator, when it
    communicates). `run(inputs)` returns the listing's outputs; `peak_arena_bytes` is the
    highest arena byte any call wrote, rounded up to the buffer alignment (measured)."""

    def __init__(self, listing: Listing, comm: ListingComm | None = None, *,
                 poison: bool = False) -> None:
        self.listing = listing
        self.comm = comm
        self.poison = poison
        self.peak_arena_bytes = 0
        self.exprs = {i: parse_expr(c["expr"]) for i, c in enumerate(listing.calls)
                      if c.kind == "kernel.pointwise"}
        self.dying: dict[int, list] = {}
        for b in listing.buffers:
            self.dying.setdefault(b.last, []).append(b)

    # --- memory ------------------------------------------------------------------------------

    def tensor(self, addr: Addr, dtype: str | torch.dtype, shape: Sequence[int],
               strides: Sequence[int]) -> torch.Tensor:
        """The elements at `addr` as a strided view; fails if any lies outside its region."""
        dt = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        region = self.regions[addr.region]
        itemsize = torch.empty((), dtype=dt).element_size()
        if addr.offset % itemsize:
            raise BackendError(f"address {addr} is not aligned for {dt}")
        if any(s == 0 for s in shape):
            span = 0
        else:
            span = (sum((s - 1) * abs(st) for s, st in zip(shape, strides)) + 1) * itemsize
        if addr.offset + span > region.numel():
            raise BackendError(f"{list(shape)} elements at {addr} with strides {list(strides)} "
                               f"end at byte {addr.offset + span}, past the {addr.region} "
                               f"region's {region.numel()} bytes")
        base = region[addr.offset:].view(dt)
        return torch.as_strided(base, tuple(shape), tuple(strides))

    torch_dtype = staticmethod(torch_dtype)

    def _wrote(self, addr: Addr, nbytes: int) -> None:
        if addr.region == "arena":
            end = -(-(addr.offset + nbytes) // ALIGNMENT) * ALIGNMENT
            self.peak_arena_bytes = max(self.peak_arena_bytes, end)

    def _write(self, addr: Addr, dtype: str, shape: Sequence[int], strides: Sequence[int],
               value: torch.Tensor) -> None:
        target = self.tensor(addr, dtype, shape, strides)
        target.copy_(value.broadcast_to(target.shape) if value.dim() else value)
        span = sum((s - 1) * st for s, st in zip(shape, strides)) + 1 if all(shape) else 0
        self._wrote(addr, span * target.element_size())

    # --- running -----------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
            ) -> list[torch.Tensor]:
        listing = self.listing
        if not isinstance(inputs, Mapping):
            inputs = {ref.name: t for ref, t in zip(listing.inputs, inputs)}
        self.regions = {"arena": torch.full((listing.arena_bytes,), POISON, dtype=torch.uint8),
                        "state": torch.zeros(listing.state_bytes, dtype=torch.uint8)}
        self.peak_arena_bytes = 0
        for ref in listing.inputs:
            if ref.name not in inputs:
                raise BackendError(f"listing @{listing.name}: no tensor given for input "
                                   f"{ref.name}")
            t = inputs[ref.name]
            if tuple(t.shape) != ref.shape:
                raise BackendError(f"listing @{listing.name}: input {ref.name} expects shape "
                                   f"{list(ref.shape)}, got {list(t.shape)}")
            self.tensor(ref.addr, ref.dtype, ref.shape, ref.strides).copy_(t)
        group: list[tuple[int, Call]] | None = None
        with torch.no_grad():
            for i, call in enumerate(listing.calls):
                try:
                    if call.kind == "nccl.groupStart":
                        group = []
                    elif call.kind == "nccl.groupEnd":
                        self._group(group or [], call["comm"])
                        group = None
                    elif group is not None:
                        group.append((i, call))
                    else:
                        self.execute(i, call)
                except BackendError:
                    raise
                except Exception as exc:
                    raise BackendError(f"listing @{listing.name} rank {listing.rank}, call {i} "
                                       f"{call.kind} ({call.note}): {exc}") from exc
                if self.poison and group is None:
                    for b in self.dying.get(i, ()):
                        start = b.addr.offset
                        self.regions["arena"][start:start + b.nbytes].fill_(POISON)
        return [self.tensor(ref.addr, ref.dtype, ref.shape, ref.strides).clone()
                for ref in listing.outputs]

    def execute(self, index: int, call: Call) -> None:
        kind = call.kind
        if kind in ("cublas.gemmEx", "cublas.gemmStridedBatchedEx"):
            self._gemm(call)
        elif kind == "kernel.pointwise":
            self._pointwise(index, call)
        elif kind in ("kernel.softmax", "kernel.log_softmax"):
            self._softmax(call)
        elif kind in ("kernel.layer_norm", "kernel.rms_norm"):
            self._norm(call)
        elif kind == "kernel.reduce":
            self._reduce(call)
        elif kind == "kernel.embedding":
            self._embedding(call)
        elif kind in ("kernel.nll_loss", "kernel.nll_loss_backward", "kernel.arange",
                      "kernel.embedding_backward"):
            getattr(self, "_" + kind.split(".")[1])(call)
        elif kind in INDEX_KERNEL_KINDS:
            run_index_kernel(self, call)
        elif kind == "cuda.memsetAsync":
            self._bytes(call["dst"], call["count"]).fill_(call["value"])
            self._wrote(call["dst"], call["count"])
        elif kind == "cuda.memcpyAsync":
            self._bytes(call["dst"], call["count"]).copy_(self._bytes(call["src"],
                                                                      call["count"]))
            self._wrote(call["dst"], call["count"])
        elif kind.startswith("nccl."):
            self._nccl(call)
        elif kind.startswith("paged."):
            run_paged_call(self, call, paged_reference)
        else:
            raise BackendError(f"the CPU executor has no call {kind!r}")

    def _bytes(self, addr: Addr, count: int) -> torch.Tensor:
        return self.tensor(addr, torch.uint8, (count,), (1,))

    # --- cuBLAS --------------------------------------------------------------------------------

    def _operand(self, addr: Addr, dtype: str, trans: str, rows: int, cols: int, ld: int,
                 stride: int, batch: int, what: str) -> torch.Tensor:
        """op(X) as cuBLAS reads it: `rows` x `cols`, column-major storage with leading
        dimension `ld` (transposed: the stored matrix is cols x rows)."""
        stored_rows = rows if trans == "N" else cols
        if ld < max(1, stored_rows):
            raise BackendError(f"cuBLAS: ld{what}={ld} < {stored_rows}, the rows of {what} as "
                               "stored (CUBLAS_STATUS_INVALID_VALUE)")
        strides = (stride, 1, ld) if trans == "N" else (stride, ld, 1)
        return self.tensor(addr, dtype, (batch, rows, cols), strides)

    def _gemm(self, c: Call) -> None:
        m, n, k = c["m"], c["n"], c["k"]
        batch = c.get("batchCount", 1)
        a = self._operand(c["A"], c["Atype"], c["transa"], m, k, c["lda"], c.get("strideA", 0),
                          batch, "a")
        b = self._operand(c["B"], c["Btype"], c["transb"], k, n, c["ldb"], c.get("strideB", 0),
                          batch, "b")
        if c["ldc"] < max(1, m):
            raise BackendError(f"cuBLAS: ldc={c['ldc']} < m={m}")
        product = torch.bmm(a, b) * c["alpha"]
        if c["beta"] != 0.0:  # beta = 0 must not read C (it may hold NaN bytes)
            product += c["beta"] * self.tensor(c["C"], c["Ctype"], (batch, m, n),
                                               (c.get("strideC", 0), 1, c["ldc"]))
        self._write(c["C"], c["Ctype"], (batch, m, n), (c.get("strideC", m * n), 1, c["ldc"]),
                    product)

    # --- generated kernels -----------------------------------------------------------------

    def _pointwise(self, index: int, c: Call) -> None:
        shape = c["shape"]
        inputs = []
        k = 0
        while f"in{k}" in c.args:
            inputs.append(self.tensor(c[f"in{k}"], c[f"in{k}_dtype"], shape, c[f"in{k}_strides"]))
            k += 1
        value = evaluate_expr(self.exprs[index], inputs)
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value)
        value = value.to(torch_dtype(c["out_dtype"])).broadcast_to(shape)
        self._write(c["out"], c["out_dtype"], shape, c["out_strides"], value.contiguous())

    def _rows(self, addr: Addr, c: Call) -> torch.Tensor:
        return self.tensor(addr, c["dtype"], (c["rows"], c["cols"]), (c["cols"], 1))

    def _softmax(self, c: Call) -> None:
        x = self._rows(c["x"], c).clone()
        if c["causal"]:  # query i of each row block sees keys 0..i (top-left aligned)
            i = torch.arange(c["rows"]) % c["sq"]
            x = x.masked_fill(torch.arange(c["cols"])[None, :] > i[:, None], float("-inf"))
        fn = torch.softmax if c.kind == "kernel.softmax" else torch.log_softmax
        self._write(c["y"], c["dtype"], (c["rows"], c["cols"]), (c["cols"], 1), fn(x, -1))
        if c.get("lse") is not None:
            self._write(c["lse"], c["dtype"], (c["rows"],), (1,), torch.logsumexp(x, -1))

    def _norm(self, c: Call) -> None:
        x = self._rows(c["x"], c)
        cols = c["cols"]
        w = None if c.get("w") is None else self.tensor(c["w"], c["dtype"], (cols,), (1,))
        if c.kind == "kernel.layer_norm":
            b = None if c.get("b") is None else self.tensor(c["b"], c["dtype"], (cols,), (1,))
            y, mean, rstd = torch.ops.aten.native_layer_norm(x, (cols,), w, b, c["eps"])
            if c.get("mean") is not None:
                self._write(c["mean"], c["dtype"], (c["rows"],), (1,), mean.reshape(-1))
                self._write(c["rstd"], c["dtype"], (c["rows"],), (1,), rstd.reshape(-1))
        else:
            y = F.rms_norm(x, (cols,), w, c["eps"])
        self._write(c["y"], c["dtype"], (c["rows"], cols), (cols, 1), y)

    def _reduce(self, c: Call) -> None:
        x = self.tensor(c["x"], c["x_dtype"], c["shape"], c["x_strides"])
        op = get_op(c["op"]).reference
        y = op(x, dims=list(c["dims"]), keepdim=False).to(torch_dtype(c["y_dtype"]))
        self._write(c["y"], c["y_dtype"], (y.numel(),), (1,), y.reshape(-1))

    def _embedding(self, c: Call) -> None:
        rows, cols = c["rows"], c["cols"]
        w = self.tensor(c["weight"], c["dtype"], (c["vocab"], cols), (cols, 1))
        idx = self.tensor(c["index"], c["index_dtype"], (rows,), (1,))
        self._write(c["y"], c["dtype"], (rows, cols), (cols, 1), w[idx.long()])

    def _class_weight(self, c: Call) -> torch.Tensor | None:
        return None if c.get("weight") is None else self._flat(c["weight"], c["dtype"],
                                                                  c["classes"])

    def _nll_loss(self, c: Call) -> None:
        logp = self._flat(c["logp"], c["dtype"], c["rows"] * c["classes"])
        target = self._flat(c["target"], c["target_dtype"], c["rows"])
        loss, total = torch.ops.aten.nll_loss_forward(
            logp.view(c["rows"], c["classes"]), target, self._class_weight(c), c["reduction"],
            c["ignore_index"])
        self._write(c["loss"], c["dtype"], (), (), loss)
        self._write(c["total_weight"], c["dtype"], (), (), total)

    def _nll_loss_backward(self, c: Call) -> None:
        rows, classes = c["rows"], c["classes"]
        grad = self.tensor(c["grad"], c["dtype"], (), ())
        target = self._flat(c["target"], c["target_dtype"], rows)
        total = self.tensor(c["total_weight"], c["dtype"], (), ())
        shape = torch.empty(rows, classes, dtype=torch_dtype(c["dtype"]))
        y = torch.ops.aten.nll_loss_backward(grad, shape, target, self._class_weight(c),
                                             c["reduction"],
                                             c["ignore_index"], total)
        self._write(c["y"], c["dtype"], (rows, classes), (classes, 1), y)

    def _arange(self, c: Call) -> None:
        y = torch.arange(c["n"], dtype=torch_dtype(c["dtype"])) * c["step"] + c["start"]
        self._write(c["y"], c["dtype"], (c["n"],), (1,), y)

    def _embedding_backward(self, c: Call) -> None:
        rows, cols = c["rows"], c["cols"]
        grad = self.tensor(c["grad"], c["dtype"], (rows, cols), (cols, 1))
        index = self._flat(c["index"], c["index_dtype"], rows).long()
        keep = index != c["padding_idx"]
        y = self.tensor(c["y"], c["dtype"], (c["vocab"], cols), (cols, 1))
        self._write(c["y"], c["dtype"], (c["vocab"], cols), (cols, 1),
                    y.index_add(0, index[keep], grad[keep]))

    # --- NCCL --------------------------------------------------------------------------------

    @staticmethod
    def _axes(comm_name: str) -> tuple[int, ...]:
        if not comm_name.startswith("axes"):
            raise BackendError(f"unknown communicator {comm_name!r}")
        return tuple(int(a) for a in comm_name[4:].split("_"))

    def _need_comm(self, c: Call) -> ListingComm:
        if self.comm is None:
            raise BackendError(f"{c.kind} needs this rank's communicator: run the listing with "
                               "comm= (graphpar.runtime.cuda_listing runs every rank)")
        return self.comm

    def _flat(self, addr: Addr, dtype: str, count: int) -> torch.Tensor:
        return self.tensor(addr, dtype, (count,), (1,))

    def _nccl(self, c: Call) -> None:
        dt = c["datatype"]
        kind = c.kind
        if kind == "nccl.send":
            self._need_comm(c).send(self._flat(c["sendbuff"], dt, c["count"]).clone(), c["peer"])
            return
        if kind == "nccl.recv":
            got = self._need_comm(c).recv((c["count"],), torch_dtype(dt), c["peer"])
            self._write(c["recvbuff"], dt, (c["count"],), (1,), got)
            return
        axes = self._axes(c["comm"])
        if kind == "nccl.allReduce":
            x = self._flat(c["sendbuff"], dt, c["count"]).clone()
            y = self._need_comm(c).all_reduce(x, axes, c["op"])
            self._write(c["recvbuff"], dt, (c["count"],), (1,), y)
        elif kind == "nccl.allGather":
            x = self._flat(c["sendbuff"], dt, c["sendcount"]).clone()
            y = self._need_comm(c).all_gather(x, axes, 0)
            self._write(c["recvbuff"], dt, (y.numel(),), (1,), y)
        elif kind == "nccl.reduceScatter":
            comm = self._need_comm(c)
            n = len(comm.group(axes))  # type: ignore[attr-defined]
            x = self._flat(c["sendbuff"], dt, c["recvcount"] * n).clone()
            y = comm.reduce_scatter(x, axes, 0, c["op"])
            self._write(c["recvbuff"], dt, (c["recvcount"],), (1,), y)
        else:
            raise BackendError(f"the CPU executor has no NCCL call {kind!r}")

    def _group(self, calls: list[tuple[int, Call]], comm_name: str) -> None:
        """A grouped exchange (all-to-all as send/recv to every peer, and a copy to itself):
        one all_to_all of the chunks in group order."""
        copies = [c for _, c in calls if c.kind == "cuda.memcpyAsync"]
        sends = {c["peer"]: c for _, c in calls if c.kind == "nccl.send"}
        recvs = {c["peer"]: c for _, c in calls if c.kind == "nccl.recv"}
        if not sends:
            for c in copies:
                self.execute(-1, c)
            return
        n = len(sends) + len(copies)
        me = next(p for p in range(n) if p not in sends)
        (own,) = copies
        dt = next(iter(sends.values()))["datatype"]
        itemsize = torch.empty((), dtype=torch_dtype(dt)).element_size()
        count = own["count"] // itemsize
        chunks = [self._flat(own["src"], dt, count) if p == me
                  else self._flat(sends[p]["sendbuff"], dt, count) for p in range(n)]
        comm = self.comm
        if comm is None:
            raise BackendError("a grouped send/recv needs this rank's communicator")
        got = comm.all_to_all(torch.stack(chunks).clone(), self._axes(comm_name), 0, 0)
        for p in range(n):
            dst = own["dst"] if p == me else recvs[p]["recvbuff"]
            self._write(dst, dt, (count,), (1,), got[p])


def run_paged_call(executor: Any, c: Call, kernels: Any) -> None:
    """A `paged.*` call on `executor`'s memory (its `tensor(addr, dtype, shape, strides)`
    views) by `kernels`: the pure-torch reference on the CPU, the CUDA kernels on a GPU."""

    def dense(key: str, dtype: str, *shape: int) -> torch.Tensor:
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        return executor.tensor(c[key], dtype, shape, strides)

    cache = (c["num_blocks"], c["block_size"], c["kv_heads"], c["head_size"])
    kc, vc = dense("key_cache", c["dtype"], *cache), dense("value_cache", c["dtype"], *cache)
    if c.kind == "paged.reshape_and_cache":
        token = (c["tokens"], c["kv_heads"], c["head_size"])
        reshape_and_cache_with(kernels, kc, vc, dense("key", c["dtype"], *token),
                               dense("value", c["dtype"], *token),
                               dense("slot_mapping", c["slot_dtype"], c["tokens"]))
        return
    if c.kind != "paged.attention":
        raise BackendError(f"no paged call {c.kind!r}")
    query = dense("query", c["dtype"], c["tokens"], c["heads"], c["head_size"])
    starts = None if c.get("query_start_loc") is None else dense(
        "query_start_loc", c["starts_dtype"], c["seqs"] + 1)
    out = paged_attention_with(
        kernels, query, kc, vc, dense("block_tables", c["index_dtype"], c["seqs"],
                                      c["max_blocks"]),
        dense("context_lens", c["lens_dtype"], c["seqs"]), starts, c["scale"], c["mode"])
    dense("out", c["dtype"], c["tokens"], c["heads"], c["head_size"]).copy_(out)
    if hasattr(executor, "_wrote"):
        executor._wrote(c["out"], out.numel() * out.element_size())
