"""SPMD ops: collectives along mesh axes, free rank-dependent local steps, and send/recv.

These ops appear in device programs (one graph with LOCAL shapes that every device of a mesh
runs on its own shard; the graph is declared on its mesh, `graph.mesh`). Importing this module
registers them.

A collective names mesh axes, `axes=[1]` or `axes=[0, 1]` (ascending). Its group is the devices
that differ from this one only along those axes, ordered row-major over their coordinates,
lower axis major (as `Mesh.groups` and as Layout's chunk order when several axes shard one
dim). `n` is the group size, kept in the attributes so types check without the mesh; the
runtime checks it against the mesh. Each op's `comm_kind` (a cost-model `StepKind`) is declared
on its `OpDef` below, the one map between ops and steps.

    all_reduce(x)     {axes, n, op}                   reduce over the group; same shape
    all_gather(x)     {axes, n, dim}                  concat the group's tensors on dim (x n)
    reduce_scatter(x) {axes, n, dim, op}              reduce, keep my chunk of dim (/ n)
    all_to_all(x)     {axes, n, split_dim, concat_dim} chunk j of split_dim to member j; concat
                                                      what arrives on concat_dim, group order
    local_slice(x)    {axes, n, dim}                  my chunk of dim (R -> S), no communication
    local_zero(x)     {axes, n, op}                   op "sum": x at group position 0, zeros
                                                      elsewhere (R -> P); other ops: x as is
    local_pad(x)      {axes, n, dim}                  x in place in zeros n x larger on dim
                                                      (S -> P(sum))
    send(x)           {dst, tag}                      send x to global rank dst; result: x
    recv()            {src, shape, dtype, tag}        a tensor from global rank src
    send_tiles(x)     {src, dst, dim, tag}            x cut into len(dst) tiles along dim: tile
                                                      j from global rank src[j] to dst[j]
                                                      (no dim: x whole to each dst); result: x
    recv_tile()       {src, dst, shape, dtype, tag}   the tile for my rank dst[j], from src[j]

send_tiles / recv_tile are a tensor crossing between two pipeline stages' sub-meshes
(`graphpar.ir.cross_mesh`): every device of the sending sub-mesh runs send_tiles (and sends
the tiles whose src is its rank), every device of the receiving one runs recv_tile, then an
all_gather over its mesh joins the tiles (Alpa's local all-gather).

`op` is one of "sum", "avg", "max", "min". The attributes map 1:1 from a cost-model
`Step` (`graphpar.cost.communication`): lower-spmd's `emit_step` appends the node.

`OPS` lists these ops for `graphpar.ir.load_ops`.

Without a communicator these ops cannot run (they are rank-dependent): their reference
implementations handle groups of one and otherwise raise `BackendError`; run device programs
with `graphpar.runtime.spmd`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphpar.errors import BackendError
from graphpar.ir.graph import Node
from graphpar.ir.layout import REDUCE_OPS
from graphpar.ir.registry import OpDef, OpKind, StepKind, Trait, get_op
from graphpar.ir.registry import dtype as torch_dtype
from graphpar.ir.types import DTYPE_NAMES, TensorType

__all__ = [
    "COMM_OPS",
    "OPS",
    "GROUP_OPS",
    "LOCAL_OPS",
    "SPMD_OPS",
    "comm_kind",
    "is_spmd_op",
    "node_axes",
]

GROUP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""Collectives over a group of devices: every member runs the node together."""
LOCAL_OPS = ("local_slice", "local_zero", "local_pad")
"""Rank-dependent but free: no communication."""
P2P_OPS = ("send", "recv", "send_tiles", "recv_tile")
COMM_OPS = GROUP_OPS + P2P_OPS
"""The ops that communicate."""
SPMD_OPS = COMM_OPS + LOCAL_OPS
"""Every op that needs a communicator (its rank, group position or peers) to run."""

def is_spmd_op(op: str) -> bool:
    """Whether `op` needs a communicator to run (a collective, a local step, send or recv)."""
    return op in SPMD_OPS


def comm_kind(op: str) -> StepKind | None:
    """The cost model's kind for an SPMD op (`send` is SEND_RECV; a receive sends nothing:
    None)."""
    if op not in SPMD_OPS or op in ("recv", "recv_tile"):
        return None
    return StepKind(get_op(op).comm_kind)


def node_axes(node: Node) -> tuple[int, ...]:
    """The mesh axes a collective or local step runs along."""
    return _axes(node.attrs.get("axes"), node.op)


# ------------------------------------------------------------------------- type rules

def _axes(value: Any, op: str) -> tuple[int, ...]:
    axes = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(axes, (tuple, list)) or not axes
            or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in axes)):
        raise TypeError(f"{op}: axes must be a list of mesh axis indices like [1] or [0, 1], "
                        f"got {value!r}")
    axes = tuple(axes)
    if list(axes) != sorted(set(axes)):
        raise TypeError(f"{op}: axes {list(axes)} must be distinct and ascending (the group is "
                        "ordered row-major over them, lower axis major)")
    return axes


def _n(attrs: dict[str, Any], op: str) -> int:
    n = attrs.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TypeError(f"{op}: n (the group size) must be an int >= 1, got {n!r}")
    return n


def _reduce_op(attrs: dict[str, Any], op: str, x: TensorType) -> str:
    reduce_op = attrs.get("op", "sum")
    if reduce_op not in REDUCE_OPS:
        raise TypeError(f"{op}: op must be one of {', '.join(REDUCE_OPS)}, got {reduce_op!r}")
    if reduce_op == "avg" and not x.dtype.is_floating_point:
        raise TypeError(f"{op}: op=avg needs a floating-point tensor, got {x}")
    return reduce_op


def _tensor(operands: Sequence[Any], op: str) -> TensorType:
    if len(operands) != 1 or not isinstance(operands[0], TensorType):
        raise TypeError(f"{op} takes one tensor operand, got {len(operands)} operand(s)")
    return operands[0]


def _dim(attrs: dict[str, Any], key: str, x: TensorType, op: str) -> int:
    d = attrs.get(key)
    if not isinstance(d, int) or isinstance(d, bool) or not -x.rank <= d < x.rank:
        raise TypeError(f"{op}: {key}={d!r} is not a dim of {x}")
    return d % x.rank


def _resized(x: TensorType, dim: int, size: int) -> TensorType:
    shape = list(x.shape)
    shape[dim] = size
    return TensorType(tuple(shape), x.dtype)


def _divided(x: TensorType, dim: int, n: int, op: str) -> TensorType:
    if x.shape[dim] % n:
        raise TypeError(f"{op}: dim {dim} of {x} has size {x.shape[dim]}, not divisible by the "
                        f"group size {n}")
    return _resized(x, dim, x.shape[dim] // n)


def _check_group(operands, attrs, op) -> tuple[TensorType, int]:
    x = _tensor(operands, op)
    _axes(attrs.get("axes"), op)
    return x, _n(attrs, op)


def _all_reduce_type(operands, attrs):
    x, _ = _check_group(operands, attrs, "all_reduce")
    _reduce_op(attrs, "all_reduce", x)
    return [x]


def _all_gather_type(operands, attrs):
    x, n = _check_group(operands, attrs, "all_gather")
    dim = _dim(attrs, "dim", x, "all_gather")
    return [_resized(x, dim, x.shape[dim] * n)]


def _reduce_scatter_type(operands, attrs):
    x, n = _check_group(operands, attrs, "reduce_scatter")
    _reduce_op(attrs, "reduce_scatter", x)
    return [_divided(x, _dim(attrs, "dim", x, "reduce_scatter"), n, "reduce_scatter")]


def _all_to_all_type(operands, attrs):
    x, n = _check_group(operands, attrs, "all_to_all")
    split = _dim(attrs, "split_dim", x, "all_to_all")
    concat = _dim(attrs, "concat_dim", x, "all_to_all")
    y = _divided(x, split, n, "all_to_all")
    return [_resized(y, concat, y.shape[concat] * n)]


def _local_slice_type(operands, attrs):
    x, n = _check_group(operands, attrs, "local_slice")
    return [_divided(x, _dim(attrs, "dim", x, "local_slice"), n, "local_slice")]


def _local_zero_type(operands, attrs):
    x, _ = _check_group(operands, attrs, "local_zero")
    _reduce_op(attrs, "local_zero", x)
    return [x]


def _local_pad_type(operands, attrs):
    x, n = _check_group(operands, attrs, "local_pad")
    dim = _dim(attrs, "dim", x, "local_pad")
    return [_resized(x, dim, x.shape[dim] * n)]


def _rank_attr(attrs, key, op) -> int:
    r = attrs.get(key)
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        raise TypeError(f"{op}: {key} must be a global rank (an int >= 0), got {r!r}")
    tag = attrs.get("tag", 0)
    if not isinstance(tag, int) or isinstance(tag, bool) or tag < 0:
        raise TypeError(f"{op}: tag must be an int >= 0, got {tag!r}")
    return r


def _send_type(operands, attrs):
    x = _tensor(operands, "send")
    _rank_attr(attrs, "dst", "send")
    return [x]


def _received_type(operands, attrs, op) -> TensorType:
    if operands:
        raise TypeError(f"{op} takes no operands, got {len(operands)}")
    shape, name = attrs.get("shape"), attrs.get("dtype")
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise TypeError(f"{op}: shape must be a list of sizes, got {shape!r}")
    if name not in DTYPE_NAMES.values():
        raise TypeError(f"{op}: dtype must be an IR dtype name "
                        f"({', '.join(DTYPE_NAMES.values())}), got {name!r}")
    return TensorType(tuple(shape), torch_dtype(name))


def _recv_type(operands, attrs):
    _rank_attr(attrs, "src", "recv")
    return [_received_type(operands, attrs, "recv")]


def _tile_ranks(attrs, op) -> int:
    """Check `src` and `dst` (one global rank per tile) and `tag`; the number of tiles."""
    src, dst = attrs.get("src"), attrs.get("dst")
    for key, ranks in (("src", src), ("dst", dst)):
        if not isinstance(ranks, (tuple, list)) or not ranks:
            raise TypeError(f"{op}: {key} must be a list of global ranks, one per tile, got "
                            f"{ranks!r}")
        for r in ranks:
            _rank_attr({key: r, "tag": attrs.get("tag", 0)}, key, op)
    if len(src) != len(dst) or len(set(dst)) != len(dst) or set(src) & set(dst):
        raise TypeError(f"{op}: src {list(src)} and dst {list(dst)} must name one sender and "
                        "one distinct receiver per tile, on two disjoint sub-meshes")
    return len(dst)


def _send_tiles_type(operands, attrs):
    x = _tensor(operands, "send_tiles")
    n = _tile_ranks(attrs, "send_tiles")
    if attrs.get("dim") is not None:
        _divided(x, _dim(attrs, "dim", x, "send_tiles"), n, "send_tiles")
    return [x]


def _recv_tile_type(operands, attrs):
    _tile_ranks(attrs, "recv_tile")
    return [_received_type(operands, attrs, "recv_tile")]


# ------------------------------------------------------------------------- references

def _no_comm(op: str):
    """The reference of an SPMD op: fine for a group of one, else a clear error."""

    def reference(*args, **attrs):
        if op in P2P_OPS or attrs.get("n") != 1:
            raise BackendError(
                f"{op} is an SPMD op: it needs the device's rank and its peers. Run device "
                "programs with graphpar.runtime.spmd.run_spmd_in_process / "
                "run_spmd_multiprocess, or pass comm= to graphpar.backends.reference.run")
        (x,) = args
        return x.clone()

    return reference


_TYPE_RULES = {
    "all_reduce": _all_reduce_type,
    "all_gather": _all_gather_type,
    "reduce_scatter": _reduce_scatter_type,
    "all_to_all": _all_to_all_type,
    "local_slice": _local_slice_type,
    "local_zero": _local_zero_type,
    "local_pad": _local_pad_type,
    "send": _send_type,
    "recv": _recv_type,
    "send_tiles": _send_tiles_type,
    "recv_tile": _recv_tile_type,
}

_DOCS = {
    "all_reduce": "all_reduce(x) {axes, n, op}: reduce over the mesh-axis group",
    "all_gather": "all_gather(x) {axes, n, dim}: concatenate the group's tensors on dim",
    "reduce_scatter": "reduce_scatter(x) {axes, n, dim, op}: reduce, keep my chunk of dim",
    "all_to_all": "all_to_all(x) {axes, n, split_dim, concat_dim}: chunk j of split_dim to "
                  "member j, concatenate what arrives on concat_dim",
    "local_slice": "local_slice(x) {axes, n, dim}: my chunk of dim (R -> S), a copy, no "
                   "communication",
    "local_zero": "local_zero(x) {axes, n, op}: sum: x at group position 0, zeros elsewhere "
                  "(R -> P), a copy, no communication",
    "local_pad": "local_pad(x) {axes, n, dim}: x in place in zeros n x larger (S -> P), a "
                 "copy, no communication",
    "send": "send(x) {dst, tag}: send x to global rank dst; the result is x",
    "recv": "recv() {src, shape, dtype, tag}: receive a tensor from global rank src",
    "send_tiles": "send_tiles(x) {src, dst, dim, tag}: x cut into len(dst) tiles along dim, "
                  "tile j sent by global rank src[j] to dst[j] (no dim: x whole to each)",
    "recv_tile": "recv_tile() {src, dst, shape, dtype, tag}: the tile for my rank dst[j], "
                 "from src[j]",
}


def _zero_flops(operands, results, attrs) -> int:
    return 0


_COMM_KINDS = {
    "all_reduce": StepKind.ALL_REDUCE,
    "all_gather": StepKind.ALL_GATHER,
    "reduce_scatter": StepKind.REDUCE_SCATTER,
    "all_to_all": StepKind.ALL_TO_ALL,
    "send": StepKind.SEND_RECV,
    "recv": StepKind.SEND_RECV,
    "send_tiles": StepKind.SEND_RECV,
    "recv_tile": StepKind.SEND_RECV,
    "local_slice": StepKind.LOCAL_SLICE,
    "local_zero": StepKind.LOCAL_ZERO,
    "local_pad": StepKind.LOCAL_PAD,
}

# Device-program ops: auto-shard never sees them, it runs on global graphs.
# The local steps communicate nothing but write a new tensor (the runtime's `local_slice`
# clones its chunk, `local_pad` fills zeros around it): a device program's node costs them as
# copies, by their bytes. Collectives are priced by the alpha-beta model, not here.
OPS = [OpDef(op, OpKind.COLLECTIVE, _no_comm(op), type_rule=_TYPE_RULES[op],
             flop_rule=_zero_flops, doc=_DOCS[op], comm_kind=_COMM_KINDS[op],
             traits=frozenset({Trait.REPLICATE_ONLY}),
             cost_class="elementwise" if op in LOCAL_OPS else None) for op in SPMD_OPS]
