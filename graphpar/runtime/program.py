"""SPMD device programs as a runtime receives them: loading and checking them, and their results.

A device program is one graph per rank of a mesh (the same graph for SPMD, one per rank for
MPMD); `load_program` parses and checks it for the mesh, `SpmdResult` is what running it gives
(each rank's outputs and what it sent). Both runners (`graphpar.runtime.spmd` in one process,
`graphpar.runtime.launch` one process per rank) share these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from graphpar.errors import BackendError, GraphparError
from graphpar.ir.graph import Graph
from graphpar.ir.mesh import Mesh, parse_mesh_shape
from graphpar.ir.spmd_ops import GROUP_OPS, LOCAL_OPS, node_axes
from graphpar.ir.verify import describe
from graphpar.runtime.comm import CommRecord

__all__ = ["GraphArg", "Inputs", "MeshArg", "SpmdResult", "StepTimes", "check_program",
           "load_program", "resolve_mesh"]

Inputs = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
GraphArg = Graph | str | Sequence[Graph | str]
MeshArg = Mesh | str | Sequence[int] | None


class SpmdResult(list):
    """The outputs of every rank (`result[rank][i]`), with what each rank sent:
    `records[rank]` (one `CommRecord` per communicating node), `bytes_sent[rank]` (by the
    plan's definition) and, when the ranks ran over process groups (`counted`),
    `bytes_counted[rank]` (the payloads handed to torch.distributed)."""

    def __init__(self, outputs: Sequence[Sequence[torch.Tensor]],
                 records: Sequence[Sequence[CommRecord]], counted: bool = False):
        super().__init__(list(o) for o in outputs)
        self.records: list[list[CommRecord]] = [list(r) for r in records]
        self.counted = counted

    @property
    def bytes_sent(self) -> list[float]:
        """Bytes each rank sent in all (cost-model definition of each collective)."""
        return [sum(r.bytes_sent for r in recs) for recs in self.records]

    @property
    def bytes_counted(self) -> list[float] | None:
        """Payload bytes each rank handed to torch.distributed in all; None when the ranks
        ran in this process (no wire: nothing to count)."""
        if not self.counted:
            return None
        return [sum(r.bytes_counted or 0.0 for r in recs) for recs in self.records]

    def bytes_by_node(self, rank: int = 0) -> dict[int | None, float]:
        """Bytes `rank` sent per node index."""
        out: dict[int | None, float] = {}
        for r in self.records[rank]:
            out[r.node] = out.get(r.node, 0.0) + r.bytes_sent
        return out


class StepTimes:
    """Measured seconds of repeated steps of a device program: `wall[rank][i]` and
    `cpu[rank][i]` (that rank's process CPU time) for timed step i, every rank starting each
    step together. A step takes as long as its slowest rank: `step_seconds[i]` is the max over
    ranks of step i's wall time."""

    def __init__(self, wall: Sequence[Sequence[float]], cpu: Sequence[Sequence[float]],
                 warmup: int = 0):
        self.wall = [list(w) for w in wall]
        self.cpu = [list(c) for c in cpu]
        self.warmup = warmup  # untimed steps run before them
        # when profiled: per rank, each node's (by graph position) mean seconds per step,
        # its slowest step dropped
        self.node_seconds: list[dict[int, float]] = []

    @property
    def step_seconds(self) -> list[float]:
        return [max(per_rank) for per_rank in zip(*self.wall)]

    @property
    def steps(self) -> int:
        return len(self.step_seconds)

    @property
    def median(self) -> float:
        return _median(self.step_seconds)

    @property
    def min(self) -> float:
        return min(self.step_seconds)

    @property
    def cpu_median(self) -> float:
        """The median over steps of the max over ranks of CPU seconds (well below the wall
        time when the ranks wait on each other or share cores with other work)."""
        return _median([max(per_rank) for per_rank in zip(*self.cpu)])

    def as_dict(self) -> dict:
        return {"steps": self.steps, "warmup_steps": self.warmup,
                "step_seconds_measured": self.median, "step_seconds_min": self.min,
                "step_seconds_each": self.step_seconds,
                "cpu_seconds_measured": self.cpu_median}


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# ------------------------------------------------------------------------- program checks

def resolve_mesh(mesh: MeshArg, graphs: Sequence[Graph] = ()) -> Mesh:
    """A Mesh from a Mesh, "2x4" or (2, 4); with None, the mesh the graphs are declared on."""
    if mesh is None:
        meshes = {g.mesh for g in graphs}
        if len(meshes) != 1 or None in meshes:
            raise BackendError("no mesh given and the program's graphs are not all declared "
                               "on the same mesh; pass mesh=")
        mesh = meshes.pop()
    if isinstance(mesh, Mesh):
        return mesh
    try:
        return Mesh(parse_mesh_shape(mesh))
    except GraphparError as exc:
        raise BackendError(str(exc)) from None


def check_program(graph: Graph, mesh: Mesh) -> None:
    """Raise BackendError unless `graph` is a device program for `mesh`: the mesh it is declared
    on (if any) has the same shape, no `reshard` node is left, and every collective's axes and
    group size `n` fit the mesh."""
    if graph.mesh is not None and graph.mesh.shape != mesh.shape:
        raise BackendError(f"graph @{graph.name} is a program for mesh {graph.mesh} but runs on "
                           f"mesh {mesh}")
    for index, node in enumerate(graph.nodes):
        where = f"graph @{graph.name}, {describe(node, graph, index)}"
        if node.op == "reshard":
            raise BackendError(f"{where}: a reshard node is left in a device program; run "
                               "lower-spmd to turn it into collectives")
        if node.op in GROUP_OPS or node.op in LOCAL_OPS:
            try:
                axes = node_axes(node)
            except TypeError as exc:
                raise BackendError(f"{where}: {exc}") from None
            if max(axes) >= mesh.ndim:
                raise BackendError(f"{where}: runs along mesh axes {list(axes)} but mesh "
                                   f"{mesh} has {mesh.ndim} axes")
            n = mesh.group_size(axes)
            if node.attrs.get("n") != n:
                raise BackendError(f"{where}: n={node.attrs.get('n')} but mesh {mesh} has "
                                   f"{n} devices along axes {list(axes)}")
        elif node.op in ("send", "recv"):
            peer = node.attrs.get("dst" if node.op == "send" else "src")
            if not isinstance(peer, int) or not 0 <= peer < mesh.size:
                raise BackendError(f"{where}: peer rank {peer!r} is not a rank of mesh {mesh} "
                                   f"(0..{mesh.size - 1})")


def load_program(graph: GraphArg, mesh: MeshArg) -> tuple[list[Graph], Mesh]:
    """One graph per rank and the mesh, from a graph or its IR text (every rank runs it) or a
    list with one graph or text per rank; each graph is checked with `check_program`."""
    from graphpar.ir.parser import parse

    if isinstance(graph, (Graph, str)):
        single = parse(graph) if isinstance(graph, str) else graph
        mesh = resolve_mesh(mesh, [single])
        graphs = [single] * mesh.size
    else:
        graphs = [parse(g) if isinstance(g, str) else g for g in graph]
        mesh = resolve_mesh(mesh, graphs)
        if len(graphs) != mesh.size:
            raise BackendError(f"{len(graphs)} graphs given for mesh {mesh} ({mesh.size} "
                               "ranks); give one graph for all ranks or one per rank")
    for g in {id(g): g for g in graphs}.values():
        check_program(g, mesh)
    return graphs, mesh
