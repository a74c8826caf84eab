"""lower-cuda for communication: NCCL calls on a communicator per mesh-axis group, the free
rank-local steps, and send/recv (whole tensors or tiles) between stages."""

from __future__ import annotations

import math
from collections.abc import Sequence

from graphpar.ir.graph import Node
from graphpar.ir.types import dtype_name
from graphpar.passes.lower_cuda.lowering import HANDLERS, Lowering
from graphpar.passes.lower_cuda.shape_ops import copy_into
from graphpar.passes.lower_cuda.values import (
    Pending,
    View,
    contiguous_strides,
    permute_view,
)

# ------------------------------------------------------------------------- communication

def _comm_name(axes: Sequence[int]) -> str:
    return "axes" + "_".join(map(str, axes))


def _split_leading(low: Lowering, v: View, dim: int, n: int) -> View:
    """`v` with `dim` split into n chunks, the chunk index moved to the front, dense: the
    layout NCCL's rank-major buffers have (no copy when dims before `dim` are all 1)."""
    chunk = v.shape[dim] // n
    shape = v.shape[:dim] + (n, chunk) + v.shape[dim + 1:]
    strides = v.strides[:dim] + (v.strides[dim] * chunk, v.strides[dim]) + v.strides[dim + 1:]
    order = (dim,) + tuple(d for d in range(len(shape)) if d != dim)
    packed = permute_view(View(v.buf, v.offset, shape, strides, v.dtype), order)
    if packed.contiguous:
        return packed
    return low.materialize(Pending(("leaf", packed), packed.shape, v.dtype))


def _join_leading(low: Lowering, staged: View, dim: int, shape: tuple[int, ...]) -> View:
    """The inverse: `staged` is [n, *chunk] dense; the result has the chunks along `dim`."""
    n = staged.shape[0]
    chunk_shape = staged.shape[1:]
    if all(s == 1 for s in shape[:dim]):
        return View(staged.buf, staged.offset, shape, contiguous_strides(shape), staged.dtype)
    out = low.new_view(shape, staged.dtype)
    split_shape = shape[:dim] + (n, chunk_shape[dim]) + shape[dim + 1:]
    strides = contiguous_strides(staged.shape)
    src_strides = strides[1:dim + 1] + (strides[0], strides[dim + 1]) + strides[dim + 2:]
    src = View(staged.buf, staged.offset, split_shape, src_strides, staged.dtype)
    target = View(out.buf, 0, split_shape, contiguous_strides(split_shape), out.dtype)
    low.materialize(Pending(("leaf", src), split_shape, staged.dtype), target)
    return out


def _collective(low: Lowering, node: Node) -> None:
    a = node.attrs
    axes = tuple(a["axes"])
    n = a["n"]
    comm = _comm_name(axes)
    t = node.output.type
    x = low.contiguous(node.inputs[0])
    count = math.prod(x.shape)
    dt = dtype_name(x.dtype)
    if node.op == "all_reduce":
        out = x if low.dead_after_now(x.buf, own_input=True) and x.whole \
            else low.new_view(t.shape, t.dtype)
        low.emit("nccl.allReduce", [("sendbuff", low.addr(x)), ("recvbuff", low.addr(out)),
                                    ("count", count), ("datatype", dt),
                                    ("op", a.get("op", "sum")), ("comm", comm)], [x], [out])
        low.bind(node.output, View(out.buf, out.offset, t.shape, contiguous_strides(t.shape),
                                   t.dtype))
    elif node.op == "all_gather":
        dim = a["dim"] % len(x.shape)
        staged = low.new_view((n,) + x.shape, x.dtype)
        low.emit("nccl.allGather", [("sendbuff", low.addr(x)), ("recvbuff", low.addr(staged)),
                                    ("sendcount", count), ("datatype", dt), ("comm", comm)],
                 [x], [staged])
        low.bind(node.output, _join_leading(low, staged, dim, t.shape))
    elif node.op == "reduce_scatter":
        dim = a["dim"] % len(x.shape)
        packed = _split_leading(low, x, dim, n)
        out = low.new_view(t.shape, t.dtype)
        low.emit("nccl.reduceScatter", [("sendbuff", low.addr(packed)),
                                        ("recvbuff", low.addr(out)), ("recvcount", count // n),
                                        ("datatype", dt), ("op", a.get("op", "sum")),
                                        ("comm", comm)], [packed], [out])
        low.bind(node.output, out)
    else:  # all_to_all: grouped send/recv of rank-major chunks
        split, concat = a["split_dim"] % len(x.shape), a["concat_dim"] % len(x.shape)
        packed = _split_leading(low, x, split, n)
        staged = low.new_view(packed.shape, x.dtype)
        chunk = count // n
        itemsize = x.itemsize
        group = low.mesh.group_of(low.device, axes)
        me = group.index(low.device)
        low.emit("nccl.groupStart", [("comm", comm)], [], [])
        for peer in range(n):
            send = View(packed.buf, packed.offset + peer * chunk, (chunk,), (1,), x.dtype)
            recv = View(staged.buf, peer * chunk, (chunk,), (1,), x.dtype)
            if peer == me:
                low.emit("cuda.memcpyAsync", [("dst", low.addr(recv)), ("src", low.addr(send)),
                                              ("count", chunk * itemsize)], [send], [recv])
                continue
            low.emit("nccl.send", [("sendbuff", low.addr(send)), ("count", chunk),
                                   ("datatype", dt), ("peer", peer), ("comm", comm)], [send], [])
            low.emit("nccl.recv", [("recvbuff", low.addr(recv)), ("count", chunk),
                                   ("datatype", dt), ("peer", peer), ("comm", comm)], [], [recv])
        low.emit("nccl.groupEnd", [("comm", comm)], [packed], [staged])
        low.bind(node.output, _join_leading(low, staged, concat, t.shape))


def _position(low: Lowering, node: Node) -> int:
    if low.mesh is None:
        return 0
    return low.mesh.group_of(low.device, tuple(node.attrs["axes"])).index(low.device)


def _local_slice(low: Lowering, node: Node) -> None:
    v = low.view(node.inputs[0])
    dim = node.attrs["dim"] % len(v.shape)
    chunk = v.shape[dim] // node.attrs["n"]
    shape = v.shape[:dim] + (chunk,) + v.shape[dim + 1:]
    low.bind(node.output, View(v.buf, v.offset + _position(low, node) * chunk * v.strides[dim],
                               shape, v.strides, v.dtype))


def _local_zero(low: Lowering, node: Node) -> None:
    x = low.operand(node.inputs[0])
    t = node.output.type
    if node.attrs.get("op", "sum") != "sum" or _position(low, node) == 0:
        low.bind(node.output, x)
        return
    expr = ("apply", "convert", (("const", 0),), (("dtype", dtype_name(t.dtype)),))
    low.bind(node.output, Pending(expr, t.shape, t.dtype))


def _local_pad(low: Lowering, node: Node) -> None:
    t = node.output.type
    dim = node.attrs["dim"] % t.rank
    out = low.new_view(t.shape, t.dtype)
    low.emit("cuda.memsetAsync", [("dst", low.addr(out)), ("value", 0),
                                  ("count", out.buf.nbytes)], [], [out])
    source = low.operand(node.inputs[0])
    copy_into(low, out, dim, _position(low, node) * source.shape[dim], source)
    low.bind(node.output, out)


def _send(low: Lowering, node: Node) -> None:
    x = low.contiguous(node.inputs[0])
    low.emit("nccl.send", [("sendbuff", low.addr(x)), ("count", math.prod(x.shape)),
                           ("datatype", dtype_name(x.dtype)), ("peer", node.attrs["dst"]),
                           ("comm", "world")], [x], [])
    low.bind(node.output, x)


def _recv(low: Lowering, node: Node) -> None:
    t = node.output.type
    out = low.new_view(t.shape, t.dtype)
    low.emit("nccl.recv", [("recvbuff", low.addr(out)), ("count", t.numel),
                           ("datatype", dtype_name(t.dtype)), ("peer", node.attrs["src"]),
                           ("comm", "world")], [], [out])
    low.bind(node.output, out)



def _send_tiles(low: Lowering, node: Node) -> None:
    """The tiles this device sends (`graphpar.ir.cross_mesh`): one nccl.send each, from a
    dense copy of the tile where its slice of the tensor is not dense already."""
    a = node.attrs
    x = low.view(node.inputs[0])
    dim = a.get("dim")
    for j, (src, dst) in enumerate(zip(a["src"], a["dst"])):
        if src != low.device:
            continue
        if dim is None:
            tile = low.contiguous(node.inputs[0])
        else:
            d = dim % len(x.shape)
            chunk = x.shape[d] // len(a["dst"])
            shape = x.shape[:d] + (chunk,) + x.shape[d + 1:]
            tile = View(x.buf, x.offset + j * chunk * x.strides[d], shape, x.strides, x.dtype)
            if not tile.contiguous:
                tile = low.materialize(Pending(("leaf", tile), shape, x.dtype))
        low.emit("nccl.send", [("sendbuff", low.addr(tile)), ("count", math.prod(tile.shape)),
                               ("datatype", dtype_name(tile.dtype)), ("peer", dst),
                               ("comm", "world")], [tile], [])
    low.bind(node.output, x)


def _recv_tile(low: Lowering, node: Node) -> None:
    a = node.attrs
    t = node.output.type
    out = low.new_view(t.shape, t.dtype)
    peer = a["src"][list(a["dst"]).index(low.device)]
    low.emit("nccl.recv", [("recvbuff", low.addr(out)), ("count", t.numel),
                           ("datatype", dtype_name(t.dtype)), ("peer", peer),
                           ("comm", "world")], [], [out])
    low.bind(node.output, out)


HANDLERS.update({
    "all_reduce": _collective,
    "all_gather": _collective,
    "reduce_scatter": _collective,
    "all_to_all": _collective,
    "local_slice": _local_slice,
    "local_zero": _local_zero,
    "local_pad": _local_pad,
    "send": _send,
    "recv": _recv,
    "send_tiles": _send_tiles,
    "recv_tile": _recv_tile,
})
