"""Run SPMD device programs: all ranks in one process, or one process per rank over gloo.

A device program is one IR graph with LOCAL shapes that every device of a mesh runs on its
own shard, with collectives along mesh axes (`graphpar.ir.spmd_ops`), declared on its mesh
(`graph.mesh`). Ranks are positions in the mesh's row-major order.

    outs = run_spmd_in_process(graph, per_rank_inputs, mesh)      # fast, deterministic
    outs = run_spmd_multiprocess(graph, per_rank_inputs, mesh)    # gloo on 127.0.0.1
    outs[rank][i]                # output i of rank `rank`
    outs.bytes_sent[rank]        # bytes rank sent, per the cost model's definitions
    outs.bytes_counted[rank]     # payload bytes rank handed to gloo (None in one process)
    outs.records[rank]           # one CommRecord per communicating node

Both executors give bit-identical outputs and identical records (`bytes_counted`, which only
the gloo ranks have, is not compared). A list of graphs (one per
rank) runs MPMD programs, e.g. pipeline stages joined by send/recv.

`shard_tensor` / `unshard` split a global tensor by layout into a device's local tensor and
put local tensors back together (reducing Partial axes).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from graphpar.backends.interpreter import Interpreter, node_error
from graphpar.errors import BackendError, GraphparError, ShardingError
from graphpar.ir.graph import Graph, Node
from graphpar.ir.layout import Layout, Partial
from graphpar.ir.mesh import Mesh
from graphpar.ir.spmd_ops import GROUP_OPS, node_axes
from graphpar.ir.verify import describe
from graphpar.runtime.comm import CommRecord, Communicator, group_outputs, reduce_tensors
from graphpar.runtime.gloo import GlooCommunicator
from graphpar.runtime.launch import run_multiprocess
from graphpar.runtime.program import (
    GraphArg,
    Inputs,
    MeshArg,
    SpmdResult,
    check_program,
    load_program,
    resolve_mesh,
)

__all__ = [
    "CommRecord",
    "Communicator",
    "GlooCommunicator",
    "SpmdResult",
    "check_program",
    "global_shape_of",
    "load_program",
    "resolve_mesh",
    "run_spmd_in_process",
    "run_spmd_multiprocess",
    "shard_tensor",
    "unshard",
]

def _check_inputs(per_rank_inputs: Sequence[Inputs], world: int) -> None:
    if len(per_rank_inputs) != world:
        raise BackendError(f"{len(per_rank_inputs)} input sets given for a {world}-rank mesh; "
                           "give one per rank, in the mesh's row-major order")


# ------------------------------------------------------------------------- in one process

class LocalCommunicator(Communicator):
    """A rank's communicator inside `run_spmd_in_process`: it runs the local steps and keeps
    the rank's records; the runner performs each collective for the whole group at once."""


def run_spmd_in_process(graph: GraphArg, per_rank_inputs: Sequence[Inputs],
                        mesh: MeshArg = None) -> SpmdResult:
    """Run a device program on every rank of `mesh` in this process; returns each rank's
    outputs (`result[rank]`), with byte records.

    Ranks advance in lockstep: each runs its local nodes until it reaches a communicating
    node; a collective runs once every member of its group has reached it (they must agree
    on the op and attributes), a send is buffered, a recv waits for its message. Results are
    deterministic (reductions go left to right in group order). A program that cannot make
    progress (mismatched collectives, a recv with no send) raises BackendError naming where
    each rank waits.
    """
    graphs, mesh = load_program(graph, mesh)
    _check_inputs(per_rank_inputs, mesh.size)
    comms = [LocalCommunicator(mesh, r) for r in range(mesh.size)]
    with torch.no_grad():
        outputs = _Lockstep(graphs, per_rank_inputs, comms).run()
    return SpmdResult(outputs, [c.records for c in comms])


class _Lockstep:
    """Drives one interpreter generator per rank; answers communicating nodes group-wise."""

    def __init__(self, graphs: list[Graph], inputs: Sequence[Inputs],
                 comms: list[LocalCommunicator]):
        self.graphs = graphs
        self.comms = comms
        self.gens = [Interpreter(g, comms[r]).steps(inputs[r]) for r, g in enumerate(graphs)]
        self.waiting: dict[int, tuple[int, Node, list]] = {}
        self.done: dict[int, list[torch.Tensor]] = {}
        self.mailbox: dict[tuple[int, int, int], deque[torch.Tensor]] = {}

    def advance(self, rank: int, value: torch.Tensor | None) -> None:
        try:
            self.waiting[rank] = self.gens[rank].send(value)
        except StopIteration as stop:
            self.waiting.pop(rank, None)
            self.done[rank] = stop.value
        except GraphparError as exc:  # a BackendError, as when a process of a rank fails
            raise BackendError(f"SPMD rank {rank} (device {self.comms[rank].device}) failed: "
                               f"{exc}") from exc

    def run(self) -> list[list[torch.Tensor]]:
        for rank in range(len(self.gens)):
            self.advance(rank, None)
        while self.waiting:
            progressed = False
            for rank in range(len(self.gens)):
                if rank in self.waiting and self.step(rank):
                    progressed = True
            if not progressed:
                raise BackendError(self.deadlock())
        return [self.done[r] for r in range(len(self.gens))]

    def step(self, rank: int) -> bool:
        """Try to answer `rank`'s request; True if something ran."""
        index, node, args = self.waiting[rank]
        comm = self.comms[rank]
        graph = self.graphs[rank]
        if node.op in ("send", "recv"):
            peer, tag = node.attrs["dst" if node.op == "send" else "src"], node.attrs.get("tag", 0)
            try:
                comm.check_peer(peer)
            except BackendError as exc:
                raise node_error(graph, node, exc) from exc
        if node.op in ("send_tiles", "recv_tile"):
            try:
                return self.tiles(rank, index, node, args)
            except BackendError as exc:
                raise node_error(graph, node, exc) from exc
        if node.op == "send":  # to `peer`
            self.mailbox.setdefault((rank, peer, tag), deque()).append(args[0].clone())
            comm.record("send", args[0], (), 2, peer=peer, node=index)
            self.advance(rank, args[0])
            return True
        if node.op == "recv":  # from `peer`
            queue = self.mailbox.get((peer, rank, tag))
            if not queue:
                return False
            message = queue.popleft()
            expected = (tuple(node.attrs["shape"]), node.outputs[0].type.dtype)
            if (tuple(message.shape), message.dtype) != expected:
                raise node_error(graph, node, BackendError(
                    f"rank {rank} expects {node.outputs[0].type} from rank {peer} (tag {tag}) "
                    f"but rank {peer} sent {tuple(message.shape)} {message.dtype}"))
            comm.record("recv", message, (), 2, peer=peer, node=index)
            self.advance(rank, message)
            return True
        # a group collective
        try:
            comm.check_group_size(node)
        except BackendError as exc:
            raise node_error(graph, node, exc) from exc
        axes = node_axes(node)
        members = comm.group(axes)
        if rank != members[0] and members[0] in self.waiting:
            return False  # the group runs when its first member is visited
        for m in members:
            if m not in self.waiting:
                return False
            _, other, _ = self.waiting[m]
            if other.op not in GROUP_OPS or node_axes(other) != axes:
                return False  # that member waits on another group first
            if other.op != node.op or other.attrs != node.attrs:
                raise BackendError(
                    f"mismatched collectives along mesh axes {list(axes)}: rank {rank} is at "
                    f"{describe(node, graph)} {node.op} {node.attrs} but rank {m} is at "
                    f"{describe(other, self.graphs[m])} {other.op} {other.attrs}")
        xs = [self.waiting[m][2][0] for m in members]
        try:
            outs = group_outputs(node.op, xs, node.attrs)
        except Exception as exc:
            raise node_error(graph, node, BackendError(
                f"{exc} (group ranks {list(members)}, input shapes "
                f"{[tuple(x.shape) for x in xs]})")) from exc
        for m, x in zip(members, xs):
            self.comms[m].record(node.op, x, axes, len(members), node=self.waiting[m][0])
        for m, out in zip(members, outs):
            self.advance(m, out)
        return True

    def tiles(self, rank: int, index: int, node: Node, args: list) -> bool:
        """send_tiles: this rank's tiles into the mailbox; recv_tile: its tile, once sent."""
        comm, attrs, tag = self.comms[rank], node.attrs, node.attrs.get("tag", 0)
        if node.op == "send_tiles":
            for peer, tile in comm.my_tiles(args[0], attrs["src"], attrs["dst"],
                                            attrs.get("dim")):
                comm.check_peer(peer)
                self.mailbox.setdefault((rank, peer, tag), deque()).append(tile.clone())
                comm.record("send", tile, (), 2, peer=peer, node=index)
            self.advance(rank, args[0])
            return True
        peer = comm.tile_source(attrs["src"], attrs["dst"])
        queue = self.mailbox.get((peer, rank, tag))
        if not queue:
            return False
        message = queue.popleft()
        comm.record("recv", message, (), 2, peer=peer, node=index)
        self.advance(rank, message)
        return True

    def deadlock(self) -> str:
        lines = ["the SPMD program cannot make progress (mismatched collectives, or a recv "
                 "with no matching send):"]
        for rank, (_, node, _) in sorted(self.waiting.items()):
            what = f"{node.op} {node.attrs}"
            if node.op in GROUP_OPS:
                group = self.comms[rank].group(node_axes(node))
                missing = [m for m in group if m not in self.waiting]
                if missing:
                    what += f" (group {list(group)}; ranks {missing} have finished)"
                else:
                    what += f" (group {list(group)})"
            lines.append(f"  rank {rank} waits at {describe(node, self.graphs[rank])}: {what}")
        return "\n".join(lines)


# ------------------------------------------------------------------------- one process per rank

def run_spmd_multiprocess(graph: GraphArg, per_rank_inputs: Sequence[Inputs],
                          mesh: MeshArg = None, timeout: float = 120.0, *,
                          deterministic: bool = True,
                          bucket_bytes: int | None = None) -> SpmdResult:
    """Run a device program with one process per rank, torch.distributed over gloo on
    127.0.0.1, launched as torchrun would (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
    LOCAL_RANK). Returns what `run_spmd_in_process` returns.

    A failing rank, or a run longer than `timeout` seconds, kills every rank and raises
    BackendError with the failing rank's message. `deterministic=False` uses gloo's own
    all-reduce (faster; sums in gloo's order, so results may differ in the last bits).
    `bucket_bytes`: run the program as a training rank does, the gradients' all-reduces and
    the updates after the backward and the all-reduces in buckets of about that many bytes
    (`graphpar.runtime.overlap`). See `graphpar.runtime.launch`."""
    return run_multiprocess(graph, per_rank_inputs, mesh, timeout=timeout,
                            deterministic=deterministic, bucket_bytes=bucket_bytes)


# ------------------------------------------------------------------------- layouts

def shard_tensor(global_tensor: torch.Tensor, layout: Layout, mesh: Mesh, device: int
                 ) -> torch.Tensor:
    """The local tensor `device` holds of `global_tensor` laid out as `layout` on `mesh`.

    Shard axes slice (`Layout.local_slices`); Partial axes hold values whose reduction is the
    tensor: for `sum`, the value on the devices at coordinate 0 of every Partial(sum) axis
    and zeros elsewhere; for `avg`, `max`, `min`, the value everywhere. A copy."""
    layout.check(tuple(global_tensor.shape), mesh)
    local = global_tensor[layout.local_slices(tuple(global_tensor.shape), mesh, device)]
    coord = mesh.coordinate(device)
    zero = any(isinstance(p, Partial) and p.reduce_op == "sum" and coord[a] != 0
               for a, p in enumerate(layout))
    return torch.zeros_like(local) if zero else local.clone()


def unshard(local_tensors: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
            layout: Layout, mesh: Mesh, check: bool = True,
            reduce: Callable[[Sequence[torch.Tensor], str], torch.Tensor] = reduce_tensors
            ) -> torch.Tensor:
    """The global tensor from every device's local tensor (a mapping device id -> tensor, or
    a sequence in rank order, i.e. `mesh.device_ids` order) laid out as `layout`.

    Partial axes are reduced in group order (all together when they share one reduce op,
    else axis by axis from the lowest) by `reduce(tensors, op)`. With `check`, replicas
    (devices holding the same slice) must agree exactly, else ShardingError names the two
    devices: a plan whose replicas diverge is wrong even if one copy is right."""
    if isinstance(local_tensors, Mapping):
        by_device = dict(local_tensors)
    else:
        if len(local_tensors) != mesh.size:
            raise ShardingError(f"{len(local_tensors)} local tensors for mesh {mesh} "
                                f"({mesh.size} devices)")
        by_device = dict(zip(mesh.device_ids, local_tensors))
    missing = [d for d in mesh.device_ids if d not in by_device]
    if missing:
        raise ShardingError(f"unshard: no local tensor for devices {missing} of mesh {mesh}")
    sample = by_device[mesh.device_ids[0]]
    local_shape = tuple(sample.shape)
    layout._check_mesh(mesh)
    layout._check_dims(len(local_shape))
    global_shape = tuple(s * layout.num_shards(d, mesh) for d, s in enumerate(local_shape))
    for d, t in by_device.items():
        if tuple(t.shape) != local_shape:
            raise ShardingError(f"unshard: device {d} holds {tuple(t.shape)}, device "
                                f"{mesh.device_ids[0]} holds {local_shape}")
    reduced = _reduce_partials(by_device, layout, mesh, reduce)
    out = sample.new_empty(global_shape)
    filled: dict[tuple, int] = {}
    for device in mesh.device_ids:
        slices = layout.local_slices(global_shape, mesh, device)
        key = tuple((s.start, s.stop) for s in slices)
        value = reduced[device]
        if key in filled:
            if check and not _same(out[slices], value):
                raise ShardingError(
                    f"unshard {layout} on mesh {mesh}: devices {filled[key]} and {device} hold "
                    f"the same slice {list(key)} with different values")
            continue
        filled[key] = device
        out[slices] = value
    return out


def _reduce_partials(by_device: dict[int, torch.Tensor], layout: Layout, mesh: Mesh,
                     reduce: Callable = reduce_tensors) -> dict[int, torch.Tensor]:
    """Every device's local tensor with the Partial axes reduced (what the group holds)."""
    partial = layout.partial_axes
    if not partial:
        return by_device
    ops = {layout[a].reduce_op for a in partial}
    stages = [partial] if len(ops) == 1 else [(a,) for a in partial]
    current = dict(by_device)
    for axes in stages:
        op = layout[axes[0]].reduce_op
        nxt: dict[int, torch.Tensor] = {}
        for group in mesh.groups(axes):
            value = reduce([current[d] for d in group], op)
            for d in group:
                nxt[d] = value
        current = nxt
    return current


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(torch.equal(a.isnan(), b.isnan())) and \
        bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))


def global_shape_of(local_shape: Sequence[int], layout: Layout, mesh: Mesh) -> tuple[int, ...]:
    """The global shape whose local shape under `layout` on `mesh` is `local_shape`."""
    return tuple(s * math.prod(mesh.shape[a] for a in layout.shard_axes(d))
                 for d, s in enumerate(local_shape))
