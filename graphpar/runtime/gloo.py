"""`GlooCommunicator`: one rank's collectives over torch.distributed process groups.

One process group per mesh-axis group, created in the same order on every rank
(`new_group` is collective). The collectives use what gloo has on CPU: by default every
group collective is an `all_gather` followed by the same group computation the in-process
executor runs (`graphpar.runtime.comm.group_*`), so reductions go left to right in group order
and both executors agree bit for bit. `deterministic=False` uses gloo's `all_reduce` for
all_reduce and reduce_scatter instead.

Byte records carry both accounts (`graphpar.runtime.comm.CommRecord`): `bytes_sent`, the
logical collective by the cost model's definition, and `bytes_counted`, the payload bytes this
process hands to torch.distributed, by what each primitive it calls moves:

- `all_gather` of B bytes in a group of n: gloo's ring all-gather (`gloo/allgather.cc`) sends
  this rank's B and forwards n-2 others' blocks to its ring neighbour: (n-1)·B;
- `all_reduce` (`deterministic=False`): gloo's ring, `ring_all_reduce_bytes`;
- `isend` of B bytes: B (a packed boundary: the packed buffer, padding included);
- `recv`/`irecv`: nothing sent.

These are payloads: gloo's message headers and TCP/IP framing are not counted, nor are the
barriers that line up timed steps (outside any program).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from graphpar.errors import BackendError
from graphpar.ir.graph import Node
from graphpar.ir.mesh import Mesh
from graphpar.ir.spmd_ops import node_axes
from graphpar.runtime.comm import (
    Communicator,
    group_all_gather,
    group_all_reduce,
    group_all_to_all,
    reduce_tensors,
)

__all__ = ["CommunicationError", "GlooCommunicator", "all_axes", "new_process_groups",
           "ring_all_reduce_bytes"]

# gloo's AllreduceOptionsImpl::kMaxSegmentSize, which ProcessGroupGloo leaves as it is
_GLOO_MAX_SEGMENT_BYTES = 1024 * 1024


class CommunicationError(BackendError):
    """A torch.distributed call failed: a peer died or closed its connection, or a timeout."""


@contextlib.contextmanager
def _communicating(what: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:
        raise CommunicationError(f"{what} failed in torch.distributed: {exc}") from exc

_NATIVE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}


def ring_all_reduce_bytes(nbytes: int, itemsize: int, n: int, rank: int,
                          max_segment_bytes: int = _GLOO_MAX_SEGMENT_BYTES) -> int:
    """The payload bytes rank `rank` (its rank in the process group: the members in ascending
    global rank) of a group of `n` sends in gloo's all-reduce of `nbytes` bytes of elements of
    `itemsize` bytes.

    What runs, in torch 2.13: ProcessGroupGloo's CPU all_reduce (`AsyncAllreduceWork`) calls
    `gloo::allreduce` with no algorithm set, and gloo (`gloo/allreduce.cc`) runs UNSPECIFIED
    as its ring, for every buffer size: there is no small-buffer special case (the bundled
    gloo has no shared-memory all-reduce either; its strings are absent from libtorch_cpu).
    The ring cuts the buffer into `numSegments` segments, a multiple of n and at least 2n, of
    `segmentBytes` each (rounded up to whole elements, so the last ones may be short or
    empty); rank r's chunk is segments [r·s, (r+1)·s), s = numSegments / n. Reduce-scatter:
    r sends every chunk but its own (r) to r - 1; all-gather: every chunk but r - 1's. Each
    send is a segment's bytes within the buffer. When the buffer cuts into equal segments
    this is 2·(n-1)/n·B, the textbook ring; otherwise ranks send a few bytes more or less,
    summing to 2·(n-1)·B over the group."""
    if n < 2 or nbytes == 0:
        return 0

    def round_up(a: int, b: int) -> int:
        return -(-a // b) * b

    max_segment = itemsize * max(1, max_segment_bytes // itemsize)
    segments = round_up(max(-(-nbytes // max_segment), 2 * n), n)
    per_rank = segments // n
    segment = round_up(-(-nbytes // segments), itemsize)

    def chunk_bytes(owner: int) -> int:
        starts = (((owner % n) * per_rank + i) * segment for i in range(per_rank))
        return sum(max(0, min(segment, nbytes - start)) for start in starts)

    return 2 * nbytes - chunk_bytes(rank) - chunk_bytes(rank - 1)


def all_axes(ndim: int) -> list[tuple[int, ...]]:
    """Every non-empty ascending tuple of mesh axes, in a fixed order."""
    return [c for k in range(1, ndim + 1) for c in itertools.combinations(range(ndim), k)]


def new_process_groups(mesh: Mesh, axes: Iterable[Sequence[int]] | None,
                       global_ranks: Sequence[int], me: int, backend: str = "gloo"
                       ) -> dict[tuple[int, ...], tuple[tuple[int, ...], object]]:
    """One process group (`backend`: gloo, or nccl for CUDA tensors) per mesh-axis group of
    `mesh` for each axes tuple in `axes` (every combination if None), in sorted order, the
    mesh's positions played by `global_ranks`. `new_group` is collective over the whole world:
    every rank calls this for every mesh with the same arguments in the same order, members or
    not. Returns the groups global rank `me` is in: axes -> (mesh positions in group order,
    process group)."""
    wanted = all_axes(mesh.ndim) if axes is None else sorted(
        {tuple(sorted(mesh.axes(tuple(a)))) for a in axes})
    mine: dict[tuple[int, ...], tuple[tuple[int, ...], object]] = {}
    for ax in wanted:
        for devices in mesh.groups(ax):
            positions = tuple(mesh.device_ids.index(d) for d in devices)
            if len(positions) == 1:
                continue
            members = [global_ranks[p] for p in positions]
            pg = dist.new_group(members, backend=backend)
            if me in members:
                mine[ax] = (positions, pg)
    return mine


class GlooCommunicator(Communicator):
    """This process's rank of `mesh`, over an initialized torch.distributed world whose size is
    the mesh's (rank r plays device `mesh.device_ids[r]`), or, with `global_ranks`, a sub-mesh
    of a larger world whose positions those global ranks play (a pipeline stage).

    `axes`: the mesh-axis tuples collectives will use (every combination if None); process
    groups are made for exactly these, in sorted order, so every rank must pass the same.
    Ranks outside a sub-mesh must make the same groups too (`new_process_groups`).
    Its records count the payloads it hands to torch.distributed (`bytes_counted`).

    `backend="nccl"` makes those groups NCCL's, for a rank whose tensors are on its GPU
    (`tensor_device`, where the receives' buffers are made); the world group stays as it was
    initialized. The byte counts are gloo's algorithms' payloads either way.
    """

    counts_payloads = True

    def __init__(self, mesh: Mesh, rank: int | None = None,
                 axes: Iterable[Sequence[int]] | None = None, *, deterministic: bool = True,
                 global_ranks: Sequence[int] | None = None, backend: str = "gloo",
                 tensor_device: torch.device | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise BackendError("GlooCommunicator needs torch.distributed initialized "
                               "(init_process_group('gloo', ...)) first")
        world, me = dist.get_world_size(), dist.get_rank()
        if global_ranks is None:
            if world != mesh.size:
                raise BackendError(f"the torch.distributed world has {world} ranks but mesh "
                                   f"{mesh} has {mesh.size} devices")
            global_ranks = range(mesh.size)
        global_ranks = tuple(global_ranks)
        if not all(0 <= r < world for r in global_ranks):
            raise BackendError(f"mesh {mesh} is played by ranks {list(global_ranks)}, not all "
                               f"in the {world}-rank torch.distributed world")
        if rank is None:
            if me not in global_ranks:
                raise BackendError(f"rank {me} plays no device of mesh {mesh} (ranks "
                                   f"{list(global_ranks)})")
            rank = global_ranks.index(me)
        super().__init__(mesh, rank, global_ranks, world)
        self.deterministic = deterministic
        self.tensor_device = tensor_device
        self._process_groups = new_process_groups(mesh, axes, global_ranks, self.global_rank,
                                                  backend)
        self._sends: list[tuple[object, torch.Tensor]] = []
        # launched buckets by their nodes and shapes: mesh axes, reduce op and byte records
        self._buckets: dict[tuple, tuple[tuple[int, ...], str, list]] = {}

    # ----------------------------------------------------------------- helpers

    def _pg(self, axes: tuple[int, ...]):
        try:
            ranks, pg = self._process_groups[axes]
        except KeyError:
            raise BackendError(f"rank {self.rank}: no process group for mesh axes {list(axes)}; "
                               "create the GlooCommunicator with those axes") from None
        return ranks, pg

    def _gather(self, x: torch.Tensor, axes: tuple[int, ...]) -> list[torch.Tensor]:
        """Every member's `x`, in group order."""
        ranks, pg = self._pg(axes)
        send = x.contiguous()
        if send.dtype == torch.bool:
            send = send.view(torch.uint8)
        parts = [torch.empty_like(send) for _ in ranks]
        with _communicating(f"all_gather over ranks {list(ranks)}"):
            dist.all_gather(parts, send, group=pg)
        # gloo's ring all-gather: this rank's block and n-2 forwarded ones, to one neighbour
        self._count((len(ranks) - 1) * send.numel() * send.element_size())
        # all_gather fills parts in the process group's rank order: ascending global rank
        members = [self.global_ranks[p] for p in ranks]
        by_rank = dict(zip(sorted(members), parts))
        out = [by_rank[r] for r in members]
        return [p.view(torch.bool) for p in out] if x.dtype == torch.bool else out

    def _native_all_reduce(self, x: torch.Tensor, axes: tuple[int, ...], op: str
                           ) -> torch.Tensor:
        ranks, pg = self._pg(axes)
        out = x.clone().contiguous()
        with _communicating(f"all_reduce over ranks {list(ranks)}"):
            dist.all_reduce(out, op=_NATIVE_OPS[op], group=pg)
        members = sorted(self.global_ranks[p] for p in ranks)  # the process group's order
        self._count(ring_all_reduce_bytes(out.numel() * out.element_size(), out.element_size(),
                                          len(ranks), members.index(self.global_rank)))
        if op == "avg":
            out.div_(len(ranks))
        return out

    # ----------------------------------------------------------------- collectives

    def _all_reduce(self, x, axes, op):
        if not self.deterministic:
            return self._native_all_reduce(x, axes, op)
        return group_all_reduce(self._gather(x, axes), op)

    def _all_gather(self, x, axes, dim):
        return group_all_gather(self._gather(x, axes), dim)

    def _reduce_scatter(self, x, axes, dim, op):
        n, p = len(self.group(axes)), self.position(axes)
        if self.deterministic:
            reduced = reduce_tensors(self._gather(x, axes), op)
        else:
            reduced = self._native_all_reduce(x, axes, op)
        return torch.split(reduced, x.shape[dim] // n, dim)[p].clone()

    def _all_to_all(self, x, axes, split_dim, concat_dim):
        return group_all_to_all(self._gather(x, axes), self.position(axes), split_dim,
                                concat_dim)

    def _send(self, x, dst, tag):
        buf = x.contiguous()
        with _communicating(f"send to rank {dst}"):
            self._sends.append((dist.isend(buf, dst=dst, tag=tag), buf))
        self._count(buf.numel() * buf.element_size())

    def _recv(self, shape, dtype, src, tag):
        out = torch.empty(shape, dtype=dtype, device=self.tensor_device)
        with _communicating(f"recv from rank {src}"):
            dist.recv(out, src=src, tag=tag)
        return out

    def _post_recv(self, shape, dtype, src, tag):
        # posted before the sender's isend, gloo writes the data from that isend at once and
        # this process's I/O thread reads it in the background; posted after, the data waits
        # for the sending process's I/O thread to see the receive's notice (docs/pipeline.md)
        out = torch.empty(shape, dtype=dtype, device=self.tensor_device)
        with _communicating(f"recv from rank {src}"):
            work = dist.irecv(out, src=src, tag=tag)

        def wait() -> torch.Tensor:
            with _communicating(f"recv from rank {src}"):
                work.wait()
            return out
        return wait

    # ----------------------------------------------------------------- bucketed, asynchronous

    def launch_all_reduce(self, requests: Sequence[tuple[int, Node, Sequence]]
                          ) -> Callable[[], list[torch.Tensor]]:
        """Start the all-reduce nodes `requests` ((index, node, operands), one mesh-axes group,
        reduce op and dtype: a bucket of `graphpar.runtime.overlap`) as one collective on one
        flat buffer, without waiting; the returned function waits and gives each node's result
        (a view of the buffer), as `execute` would have. Each node gets its record now; the
        payload is counted on the first one. A bucket launched again (the next step) is
        checked and priced once: its records are the first launch's."""
        key = tuple((index, *args[0].shape) for index, _, args in requests)
        known = self._buckets.get(key)
        if known is None:
            nodes = [node for _, node, _ in requests]
            for node in nodes:
                self.check_group_size(node)
            axes, op = node_axes(nodes[0]), nodes[0].attrs.get("op", "sum")
            if any(node_axes(n) != axes or n.attrs.get("op", "sum") != op for n in nodes):
                raise BackendError("a bucket's all-reduces must share their mesh axes and op")
        else:
            axes, op, records = known
        xs = [args[0] for _, _, args in requests]
        ranks, pg = self._pg(axes)
        flat = torch.cat([x.reshape(-1) for x in xs])
        what = f"all_reduce of a {flat.numel() * flat.element_size()}-byte bucket over ranks " \
               f"{list(ranks)}"
        with _communicating(what):
            if self.deterministic:
                parts = [torch.empty_like(flat) for _ in ranks]
                work = dist.all_gather(parts, flat, group=pg, async_op=True)
            else:
                work = dist.all_reduce(flat, op=_NATIVE_OPS[op], group=pg, async_op=True)
        if known is None:
            nbytes = flat.numel() * flat.element_size()
            members = sorted(self.global_ranks[p] for p in ranks)
            payload = ((len(ranks) - 1) * nbytes if self.deterministic else
                       ring_all_reduce_bytes(nbytes, flat.element_size(), len(ranks),
                                             members.index(self.global_rank)))
            self._count(payload)
            for k, ((index, _, _), x) in enumerate(zip(requests, xs)):
                self.record("all_reduce", x, axes, len(ranks), node=index,
                            counted=payload if k == 0 else 0)
            self._buckets[key] = (axes, op, self.records[-len(requests):])
        else:
            self.records.extend(records)

        def wait() -> list[torch.Tensor]:
            with _communicating(what):
                work.wait()
            if self.deterministic:
                by_rank = dict(zip(sorted(self.global_ranks[p] for p in ranks), parts))
                reduced = reduce_tensors([by_rank[self.global_ranks[p]] for p in ranks], op)
            else:
                reduced = flat.div_(len(ranks)) if op == "avg" else flat
            pieces = torch.split(reduced, [x.numel() for x in xs])
            return [piece.view(x.shape) for piece, x in zip(pieces, xs)]
        return wait

    def barrier(self) -> None:
        """Wait until every rank of the world gets here."""
        with _communicating("barrier"):
            dist.barrier()

    def finish(self) -> None:
        with _communicating("waiting for sends"):
            for work, _ in self._sends:
                work.wait()
        self._sends.clear()
