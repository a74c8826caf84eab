"""Communicators: one rank's view of a mesh, its collectives, and what each one sent.

`Communicator` is what the interpreter calls for SPMD ops
(`graphpar.backends.interpreter.Interpreter(graph, comm)`). It knows the mesh, its rank and
coordinate, which ranks form its group along some mesh axes, and implements the free local
steps itself; subclasses implement the collectives (`GlooCommunicator` over
torch.distributed). The in-process executor performs collectives for a whole group at once
with the `group_*` functions below, which are also what `GlooCommunicator` applies to the
tensors it gathers, so both executors compute bit-identical results.

Ranks are positions in the mesh's row-major order (0 .. mesh.size - 1); a rank's device id
is `mesh.device_ids[rank]`. Send/recv name global ranks.

Byte accounting comes in two kinds, side by side on each `CommRecord`. By the plan's
definition (`graphpar.cost.communication`): the buffer size `nbytes` as the cost model defines
it (all_reduce: the buffer; all_gather: the gathered output; reduce_scatter: the full input;
all_to_all: the local buffer; send: the message) and `bytes_sent = collective_bytes(kind,
nbytes, n)`, the logical collective's bytes per rank, whatever primitives the communicator
used to implement it: the same formula the plan's prediction uses, so it cannot disagree with
it. Counted: `bytes_counted`, the payload bytes this rank handed to torch.distributed for the
node, by what each primitive it called moves (`GlooCommunicator`); None where no process group
moved anything (the in-process executor has no wire).

Tensors bound for one rank at one time (a pipeline stage boundary: several tensors, each cut
into tiles) travel as one message: `pack` lays them end to end in one flat uint8 buffer and
`unpack` cuts the received buffer back into views, the receiver knowing every tensor's type.
Each message is a rendezvous on gloo (the data leaves once its receive is posted), so one
message per boundary and peer pays it once instead of once per tensor; a receive posted
ahead (`post_boundary`) lets the data leave from the sender's `isend` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from graphpar.cost.communication import StepKind, collective_bytes
from graphpar.errors import BackendError
from graphpar.ir.cross_mesh import TileTransfer
from graphpar.ir.graph import Node
from graphpar.ir.mesh import Mesh
from graphpar.ir.registry import get_op
from graphpar.ir.spmd_ops import COMM_OPS, GROUP_OPS, LOCAL_OPS, node_axes
from graphpar.ir.types import TensorType

__all__ = [
    "CommRecord",
    "Communicator",
    "Posted",
    "group_all_gather",
    "group_all_reduce",
    "group_all_to_all",
    "group_outputs",
    "group_reduce_scatter",
    "pack",
    "packed_offsets",
    "reduce_tensors",
    "unpack",
]


@dataclass(frozen=True)
class CommRecord:
    """What one rank sent for one communicating node.

    - `node`: the node's index in the graph (None for a direct method call);
    - `op`: the IR op; `kind`: the cost model's StepKind value ("all_reduce", "send_recv");
    - `axes`, `group_size`: the mesh axes and group size (send/recv: (), 2);
    - `nbytes`: the buffer as the cost model defines it for `kind`;
    - `bytes_sent`: `collective_bytes(kind, nbytes, group_size)`, bytes this rank sent
      by the plan's definition (0 for recv);
    - `peer`: the other rank of a send/recv;
    - `bytes_counted`: the payload bytes this rank handed to torch.distributed for it (0 for
      recv), None where no process group ran it. Not compared: a program's records are equal
      whichever executor ran it.
    """

    node: int | None
    op: str
    kind: str
    axes: tuple[int, ...]
    group_size: int
    nbytes: float
    bytes_sent: float
    peer: int | None = None
    bytes_counted: float | None = field(default=None, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> CommRecord:
        """The record `as_dict` gave (as a worker's result carries it back)."""
        return cls(**{**record, "axes": tuple(record["axes"])})


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# ------------------------------------------------------------------------- group semantics
# Inputs in group order (row-major over the axes' coordinates, lower axis major).

def reduce_tensors(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce left to right in group order: the one definition both executors use, so their
    results agree bit for bit. `avg` is the sum divided by the group size."""
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op in ("sum", "avg"):
            out.add_(t)
        elif op == "max":
            torch.maximum(out, t, out=out)
        elif op == "min":
            torch.minimum(out, t, out=out)
        else:
            raise BackendError(f"unknown reduce op {op!r}; use sum, avg, max or min")
    if op == "avg":
        out.div_(len(tensors))
    return out


def group_all_reduce(xs: Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor:
    """The all-reduce result every member gets."""
    return reduce_tensors(xs, op)


def group_all_gather(xs: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The all-gather result every member gets."""
    return torch.cat(list(xs), dim)


def group_reduce_scatter(xs: Sequence[torch.Tensor], dim: int, op: str = "sum"
                         ) -> list[torch.Tensor]:
    """Each member's reduce-scatter result, in group order."""
    reduced = reduce_tensors(xs, op)
    return [c.clone() for c in _chunks(reduced, len(xs), dim)]


def group_all_to_all(xs: Sequence[torch.Tensor], position: int, split_dim: int,
                     concat_dim: int) -> torch.Tensor:
    """Member `position`'s all-to-all result: chunk `position` of every member's tensor along
    `split_dim`, concatenated along `concat_dim` in group order."""
    n = len(xs)
    return torch.cat([_chunks(x, n, split_dim)[position] for x in xs], concat_dim)


def group_outputs(op: str, xs: Sequence[torch.Tensor], attrs: dict[str, Any]
                  ) -> list[torch.Tensor]:
    """Every member's result of group collective `op`, in group order."""
    n = len(xs)
    if op == "all_reduce":
        r = group_all_reduce(xs, attrs.get("op", "sum"))
        return [r] + [r.clone() for _ in range(n - 1)]
    if op == "all_gather":
        r = group_all_gather(xs, attrs["dim"])
        return [r] + [r.clone() for _ in range(n - 1)]
    if op == "reduce_scatter":
        return group_reduce_scatter(xs, attrs["dim"], attrs.get("op", "sum"))
    if op == "all_to_all":
        return [group_all_to_all(xs, p, attrs["split_dim"], attrs["concat_dim"])
                for p in range(n)]
    raise BackendError(f"{op} is not a group collective ({', '.join(GROUP_OPS)})")


def _chunks(x: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    size = x.shape[dim]
    if size % n:
        raise BackendError(f"dim {dim} of a {tuple(x.shape)} tensor does not split into {n} "
                           "equal chunks")
    return list(torch.split(x, size // n, dim))


def comm_nbytes(op: str, x: torch.Tensor, n: int) -> tuple[StepKind, float]:
    """The cost model's kind (the op's declared `comm_kind`) and buffer size `nbytes` for SPMD
    op `op` on input `x`: the input, except all_gather's gathered output."""
    if op not in COMM_OPS:
        raise BackendError(f"{op} does not communicate")
    kind = StepKind(get_op(op).comm_kind)
    return kind, float(_nbytes(x) * (n if kind is StepKind.ALL_GATHER else 1))


# ------------------------------------------------------------------------- one message

def packed_offsets(types: Sequence[TensorType]) -> tuple[list[int], int]:
    """Where each tensor of `types` starts in a packed buffer, and the buffer's bytes: end to
    end in order, each start rounded up to its element size so that the receiver's views of
    the buffer are aligned (a few bytes of padding at most)."""
    offsets, end = [], 0
    for ty in types:
        end += -end % ty.itemsize
        offsets.append(end)
        end += ty.nbytes
    return offsets, end


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`tensors` (any strides) copied end to end into one flat uint8 buffer (`packed_offsets`)."""
    types = [TensorType.of(t) for t in tensors]
    offsets, size = packed_offsets(types)
    buffer = torch.empty(size, dtype=torch.uint8)
    for t, part in zip(tensors, _parts(buffer, offsets, types)):
        part.copy_(t)
    return buffer


def unpack(buffer: torch.Tensor, types: Sequence[TensorType]) -> list[torch.Tensor]:
    """The tensors of a `pack`ed `buffer`, given their types: views of the buffer (they do
    not overlap, so each is as good as its own tensor; together they keep the buffer)."""
    offsets, size = packed_offsets(types)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != size:
        raise BackendError(f"a packed message of {', '.join(_str(t) for t in types)} is a flat "
                           f"uint8 buffer of {size} bytes, got {buffer.dtype} "
                           f"{tuple(buffer.shape)}: sender and receiver disagree on its "
                           "tensors")
    return _parts(buffer, offsets, types)


def _parts(buffer: torch.Tensor, offsets: Sequence[int], types: Sequence[TensorType]
           ) -> list[torch.Tensor]:
    return [buffer[o:o + ty.nbytes].view(ty.dtype).view(ty.shape)
            for o, ty in zip(offsets, types)]


def _str(ty: TensorType) -> str:
    return f"{str(ty.dtype).removeprefix('torch.')}{list(ty.shape)}"


class Posted:
    """Tensors on their way to this rank, their receives posted: `wait()` returns them (once
    they have arrived; the same list on every call)."""

    def __init__(self, wait: Callable[[], list[torch.Tensor]]) -> None:
        self._wait: Callable[[], list[torch.Tensor]] | None = wait
        self._tensors: list[torch.Tensor] = []

    def wait(self) -> list[torch.Tensor]:
        if self._wait is not None:
            self._tensors, self._wait = self._wait(), None
        return self._tensors


# ------------------------------------------------------------------------- the interface

class Communicator:
    """One rank of a mesh: its coordinate and groups, the local steps, and the collectives.

    Subclasses implement `_all_reduce`, `_all_gather`, `_reduce_scatter`, `_all_to_all`,
    `_send` and `_recv` for groups of two or more; this class handles groups of one, checks
    arguments, and records bytes (`records`, `bytes_sent`). A subclass whose primitives move
    bytes between processes sets `counts_payloads` and counts each payload it hands over
    (`_count`); each record then takes what was counted since the last one (`bytes_counted`).
    """

    counts_payloads = False  # whether records carry `bytes_counted`

    def __init__(self, mesh: Mesh, rank: int, global_ranks: Sequence[int] | None = None,
                 world_size: int | None = None):
        if not 0 <= rank < mesh.size:
            raise BackendError(f"rank {rank} is not in mesh {mesh} ({mesh.size} devices)")
        self.mesh = mesh
        self.rank = rank
        # the mesh may be a sub-mesh of a larger world (a pipeline stage): its positions are
        # these global ranks, which sends and receives name
        self.global_ranks = tuple(range(mesh.size) if global_ranks is None else global_ranks)
        if len(self.global_ranks) != mesh.size:
            raise BackendError(f"mesh {mesh} has {mesh.size} devices but {len(self.global_ranks)}"
                               " global ranks were given")
        self._world = mesh.size if world_size is None else world_size
        self.device = mesh.device_ids[rank]
        self.coordinate = mesh.coordinate(self.device)
        self.records: list[CommRecord] = []
        self._uncounted = 0  # payload bytes handed over since the last record
        self._node: int | None = None
        self._groups: dict[tuple[int, ...], tuple[int, ...]] = {}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(mesh {self.mesh}, rank {self.rank}, "
                f"coordinate {self.coordinate})")

    # ----------------------------------------------------------------- groups

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def global_rank(self) -> int:
        return self.global_ranks[self.rank]

    def axes(self, axes: int | Sequence[int]) -> tuple[int, ...]:
        """Mesh axes as an ascending tuple (the group order's convention)."""
        return tuple(sorted(self.mesh.axes(axes)))

    def group(self, axes: int | Sequence[int]) -> tuple[int, ...]:
        """The ranks of my group along `axes`, in group order (row-major over the axes'
        coordinates, lower axis major)."""
        key = self.axes(axes)
        if key not in self._groups:
            devices = self.mesh.group_of(self.device, key)
            self._groups[key] = tuple(self.mesh.device_ids.index(d) for d in devices)
        return self._groups[key]

    def position(self, axes: int | Sequence[int]) -> int:
        """My index in my group along `axes`."""
        return self.group(axes).index(self.rank)

    # ----------------------------------------------------------------- bytes

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sent in all, per the cost model's definition of each collective."""
        return sum(r.bytes_sent for r in self.records)

    @property
    def bytes_counted(self) -> float | None:
        """Payload bytes this rank handed to torch.distributed in all (None: no process group
        ran its collectives)."""
        if not self.counts_payloads:
            return None
        return sum(r.bytes_counted or 0.0 for r in self.records)

    def bytes_by_node(self) -> dict[int | None, float]:
        """Bytes sent per node index (the plan's definition)."""
        out: dict[int | None, float] = {}
        for r in self.records:
            out[r.node] = out.get(r.node, 0.0) + r.bytes_sent
        return out

    def record(self, op: str, x: torch.Tensor, axes: tuple[int, ...], n: int,
               peer: int | None = None, node: int | None = None,
               counted: int | None = None) -> CommRecord:
        """Append the record of one communicating op on input `x` (for recv: the message),
        labelled with node index `node` (default: the node `execute` is running). Its
        `bytes_counted` is what was counted since the last record, or `counted` of it."""
        kind, nbytes = comm_nbytes(op, x, n)
        sent = 0.0 if op == "recv" else collective_bytes(kind, nbytes, n)
        rec = CommRecord(self._node if node is None else node, op, kind.value, axes, n,
                         nbytes, sent, peer, self._take_counted(counted))
        self.records.append(rec)
        return rec

    def _count(self, nbytes: int) -> None:
        """Count `nbytes` of payload handed to torch.distributed (for the next record)."""
        self._uncounted += nbytes

    def _take_counted(self, share: int | None = None) -> float | None:
        if not self.counts_payloads:
            return None
        take = self._uncounted if share is None else share
        self._uncounted -= take
        return float(take)

    # ----------------------------------------------------------------- collectives

    def all_reduce(self, x: torch.Tensor, axes: int | Sequence[int], op: str = "sum"
                   ) -> torch.Tensor:
        axes = self.axes(axes)
        n = len(self.group(axes))
        out = x.clone() if n == 1 else self._all_reduce(x, axes, op)
        self.record("all_reduce", x, axes, n)
        return out

    def all_gather(self, x: torch.Tensor, axes: int | Sequence[int], dim: int) -> torch.Tensor:
        axes = self.axes(axes)
        n = len(self.group(axes))
        out = x.clone() if n == 1 else self._all_gather(x, axes, dim % x.dim())
        self.record("all_gather", x, axes, n)
        return out

    def reduce_scatter(self, x: torch.Tensor, axes: int | Sequence[int], dim: int,
                       op: str = "sum") -> torch.Tensor:
        axes = self.axes(axes)
        n = len(self.group(axes))
        out = x.clone() if n == 1 else self._reduce_scatter(x, axes, dim % x.dim(), op)
        self.record("reduce_scatter", x, axes, n)
        return out

    def all_to_all(self, x: torch.Tensor, axes: int | Sequence[int], split_dim: int,
                   concat_dim: int) -> torch.Tensor:
        axes = self.axes(axes)
        n = len(self.group(axes))
        out = x.clone() if n == 1 else self._all_to_all(x, axes, split_dim % x.dim(),
                                                         concat_dim % x.dim())
        self.record("all_to_all", x, axes, n)
        return out

    def send(self, x: torch.Tensor, dst: int, tag: int = 0) -> torch.Tensor:
        """Send `x` to global rank `dst` (may return before it is received; see `finish`)."""
        self.check_peer(dst)
        self._send(x, dst, tag)
        self.record("send", x, (), 2, peer=dst)
        return x

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int = 0
             ) -> torch.Tensor:
        """Receive a tensor of `shape` and `dtype` from global rank `src`."""
        self.check_peer(src)
        out = self._recv(tuple(shape), dtype, src, tag)
        self.record("recv", out, (), 2, peer=src)
        return out

    def send_tiles(self, x: torch.Tensor, src: Sequence[int], dst: Sequence[int],
                   dim: int | None, tag: int = 0) -> torch.Tensor:
        """Send the tiles of `x` this rank is the sender of: `x` cut into len(dst) tiles along
        `dim` (None: `x` whole), tile j from global rank src[j] to dst[j]. Returns `x`."""
        for peer, tile in self.my_tiles(x, src, dst, dim):
            self.send(tile, peer, tag)
        return x

    def my_tiles(self, x: torch.Tensor, src: Sequence[int], dst: Sequence[int],
                 dim: int | None) -> list[tuple[int, torch.Tensor]]:
        """(receiving rank, tile) of every tile of `x` this rank sends."""
        return [(d, tile.contiguous()) for d, tile in self._tiles(x, src, dst, dim)]

    def _tiles(self, x: torch.Tensor, src: Sequence[int], dst: Sequence[int],
               dim: int | None) -> list[tuple[int, torch.Tensor]]:
        """`my_tiles`, the tiles as views of `x` (what `pack` copies anyway)."""
        tiles = (list(torch.chunk(x, len(dst), dim)) if dim is not None
                 else [x] * len(dst))
        return [(d, tiles[j]) for j, (s, d) in enumerate(zip(src, dst))
                if s == self.global_rank]

    def tile_source(self, src: Sequence[int], dst: Sequence[int]) -> int:
        """The global rank that sends this rank its tile."""
        if self.global_rank not in dst:
            raise BackendError(f"rank {self.global_rank} receives no tile: the tiles go to "
                               f"ranks {list(dst)}")
        return src[list(dst).index(self.global_rank)]

    def recv_tile(self, shape: Sequence[int], dtype: torch.dtype, src: Sequence[int],
                  dst: Sequence[int], tag: int = 0) -> torch.Tensor:
        """Receive this rank's tile (`shape`, `dtype`) of a `send_tiles`."""
        return self.recv(shape, dtype, self.tile_source(src, dst), tag)

    def send_packed(self, tensors: Sequence[torch.Tensor], dst: int, tag: int = 0) -> None:
        """Send `tensors` to global rank `dst` as one message (`pack`). The byte records are
        the tensors' own, one send each, as if each had been sent alone; the counted bytes
        are the message's, padding included, each record counting its tensor and the padding
        before it."""
        self.check_peer(dst)
        message = pack(tensors)
        self._send(message, dst, tag)
        offsets, _ = packed_offsets([TensorType.of(t) for t in tensors])
        end = 0
        for t, start in zip(tensors, offsets):
            self.record("send", t, (), 2, peer=dst, counted=start + _nbytes(t) - end)
            end = start + _nbytes(t)

    def post_packed(self, types: Sequence[TensorType], src: int, tag: int = 0) -> Posted:
        """Post the receive of a `send_packed` of tensors of `types` from global rank `src`;
        the returned `Posted` gives them (views of the one message)."""
        self.check_peer(src)
        types = list(types)
        message = self._post_recv((packed_offsets(types)[1],), torch.uint8, src, tag)

        def arrived() -> list[torch.Tensor]:
            tensors = unpack(message(), types)
            for t in tensors:
                self.record("recv", t, (), 2, peer=src)
            return tensors
        return Posted(arrived)

    def send_boundary(self, parts: Sequence[tuple[torch.Tensor, TileTransfer]],
                      tag: int = 0) -> None:
        """Send this rank's tiles of several tensors, each `(x, plan)` cut as `send_tiles`
        cuts it: the tiles bound for one rank go as one message (`send_packed`), in the order
        of `parts`."""
        by_peer: dict[int, list[torch.Tensor]] = {}
        for x, plan in parts:
            for peer, tile in self._tiles(x, plan.senders, plan.dst, plan.dim):
                by_peer.setdefault(peer, []).append(tile)
        for peer, tiles in by_peer.items():
            self.send_packed(tiles, peer, tag)

    def post_boundary(self, plans: Sequence[TileTransfer], tag: int = 0) -> Posted:
        """Post the receives of this rank's tiles of a `send_boundary` (one message per
        sending rank); the returned `Posted` gives the tiles in the order of `plans`."""
        sources = [self.tile_source(p.senders, p.dst) for p in plans]
        messages = {src: self.post_packed([p.tile_type for p, s in zip(plans, sources)
                                           if s == src], src, tag)
                    for src in dict.fromkeys(sources)}

        def arrived() -> list[torch.Tensor]:
            tiles = {src: iter(m.wait()) for src, m in messages.items()}
            return [next(tiles[src]) for src in sources]
        return Posted(arrived)

    def finish(self) -> None:
        """Wait until everything this rank sent has been delivered."""

    def check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.global_rank:
            raise BackendError(f"rank {self.global_rank}: peer rank {peer} is not another rank "
                               f"of the {self.world_size}-rank world")

    # ----------------------------------------------------------------- local steps (free)

    def local_slice(self, x: torch.Tensor, axes: int | Sequence[int], dim: int) -> torch.Tensor:
        """My chunk of `dim` (R -> S along `axes`)."""
        n, p = len(self.group(axes)), self.position(axes)
        return _chunks(x, n, dim % x.dim())[p].clone()

    def local_zero(self, x: torch.Tensor, axes: int | Sequence[int], op: str = "sum"
                   ) -> torch.Tensor:
        """For `sum`: `x` at group position 0, zeros elsewhere (R -> P(sum)); for the other
        reduce ops, `x` as it is (the reduction of equal copies is the copy)."""
        if op != "sum" or self.position(axes) == 0:
            return x.clone()
        return torch.zeros_like(x)

    def local_pad(self, x: torch.Tensor, axes: int | Sequence[int], dim: int) -> torch.Tensor:
        """`x` at my position in a zero tensor `n` times larger along `dim` (S -> P(sum))."""
        n, p = len(self.group(axes)), self.position(axes)
        dim %= x.dim()
        shape = list(x.shape)
        size = shape[dim]
        shape[dim] = size * n
        out = x.new_zeros(shape)
        out.narrow(dim, p * size, size).copy_(x)
        return out

    # ----------------------------------------------------------------- IR nodes

    def execute(self, node: Node, args: Sequence[Any], index: int | None = None
                ) -> torch.Tensor:
        """Run SPMD node `node` on its operands `args` (what the reference executor calls).
        `index` (the node's position in its graph) labels the byte record."""
        op, attrs = node.op, node.attrs
        if op == "send":
            self._node = index
            try:
                return self.send(args[0], attrs["dst"], attrs.get("tag", 0))
            finally:
                self._node = None
        if op == "recv":
            from graphpar.ir.registry import dtype as torch_dtype

            self._node = index
            try:
                return self.recv(attrs["shape"], torch_dtype(attrs["dtype"]), attrs["src"],
                                 attrs.get("tag", 0))
            finally:
                self._node = None
        if op in ("send_tiles", "recv_tile"):
            from graphpar.ir.registry import dtype as torch_dtype

            self._node = index
            try:
                if op == "send_tiles":
                    return self.send_tiles(args[0], attrs["src"], attrs["dst"],
                                           attrs.get("dim"), attrs.get("tag", 0))
                return self.recv_tile(attrs["shape"], torch_dtype(attrs["dtype"]),
                                      attrs["src"], attrs["dst"], attrs.get("tag", 0))
            finally:
                self._node = None
        axes = node_axes(node)
        self.check_group_size(node)
        x = args[0]
        if op in LOCAL_OPS:
            if op == "local_slice":
                return self.local_slice(x, axes, attrs["dim"])
            if op == "local_zero":
                return self.local_zero(x, axes, attrs.get("op", "sum"))
            return self.local_pad(x, axes, attrs["dim"])
        self._node = index
        try:
            if op == "all_reduce":
                return self.all_reduce(x, axes, attrs.get("op", "sum"))
            if op == "all_gather":
                return self.all_gather(x, axes, attrs["dim"])
            if op == "reduce_scatter":
                return self.reduce_scatter(x, axes, attrs["dim"], attrs.get("op", "sum"))
            if op == "all_to_all":
                return self.all_to_all(x, axes, attrs["split_dim"], attrs["concat_dim"])
        finally:
            self._node = None
        raise BackendError(f"{op} is not an SPMD op a communicator runs")

    def check_group_size(self, node: Node) -> None:
        """Raise BackendError unless the node's `n` is its group's size on this mesh."""
        axes = node_axes(node)
        if max(axes) >= self.mesh.ndim:
            raise BackendError(f"{node.op} runs along mesh axes {list(axes)} but mesh "
                               f"{self.mesh} has {self.mesh.ndim} axes")
        n = len(self.group(axes))
        if node.attrs.get("n") != n:
            raise BackendError(f"{node.op} says n={node.attrs.get('n')} but its group along "
                               f"mesh axes {list(axes)} of mesh {self.mesh} has {n} devices; "
                               "the program was lowered for another mesh")

    # ----------------------------------------------------------------- to implement

    def _all_reduce(self, x, axes, op):
        raise self._unsupported("all_reduce")

    def _all_gather(self, x, axes, dim):
        raise self._unsupported("all_gather")

    def _reduce_scatter(self, x, axes, dim, op):
        raise self._unsupported("reduce_scatter")

    def _all_to_all(self, x, axes, split_dim, concat_dim):
        raise self._unsupported("all_to_all")

    def _send(self, x, dst, tag):
        raise self._unsupported("send")

    def _recv(self, shape, dtype, src, tag):
        raise self._unsupported("recv")

    def _post_recv(self, shape, dtype, src, tag) -> Callable[[], torch.Tensor]:
        """Post a receive now, return what waits for it. By default nothing is posted ahead:
        the receive runs when waited for."""
        return lambda: self._recv(shape, dtype, src, tag)

    def _unsupported(self, op: str) -> BackendError:
        return BackendError(f"{type(self).__name__} cannot run {op} on its own: a collective "
                            "needs the other ranks (use run_spmd_in_process, or a "
                            "GlooCommunicator in a torch.distributed job)")
