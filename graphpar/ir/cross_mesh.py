"""How a tensor crosses from one sub-mesh to another: Alpa's local all-gather (§6.1) as data.

Every device of the sending sub-mesh holds the tensor whole; every device of the receiving
sub-mesh needs it whole. Sent naively, each receiving device would get all of it and n·M bytes
would cross between the meshes. Instead the tensor is cut into one tile per receiving device
along a dimension that divides evenly; tile j crosses once, from sending device j mod
n_src (so the sending devices share the load) to receiving device j; then the receiving
sub-mesh all-gathers the tiles over its own links. M bytes cross, as
`graphpar.cost.communication.cross_mesh_cost` prices it.

A tensor with no dimension divisible by the number of receiving devices (a scalar, odd sizes)
is sent whole to each receiving device (`dim is None`); its bytes across are then n·M.

`lower_mpmd` writes a transfer as `send_tiles` / `recv_tile` (+ `all_gather`) nodes and the
pipeline runtime executes the same plan, so the program text and what the ranks send agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from graphpar.errors import PassError
from graphpar.ir.types import TensorType

__all__ = ["TileTransfer", "stage_devices", "tile_transfer"]


def stage_devices(stages: int, devices_per_stage: Sequence[int] | None = None
                  ) -> list[tuple[int, ...]]:
    """Global ranks of each stage's sub-mesh, stages laid out in order: by default one device
    each."""
    sizes = list(devices_per_stage or [1] * stages)
    if len(sizes) != stages or any(n < 1 for n in sizes):
        raise PassError(f"{stages} stages need {stages} sub-mesh sizes of at least 1, got "
                        f"{sizes}")
    out, first = [], 0
    for n in sizes:
        out.append(tuple(range(first, first + n)))
        first += n
    return out


@dataclass(frozen=True)
class TileTransfer:
    """One tensor from sub-mesh `src` to sub-mesh `dst` (global ranks, row-major)."""

    type: TensorType  # the whole tensor
    src: tuple[int, ...]
    dst: tuple[int, ...]
    dim: int | None  # the dim cut into len(dst) tiles; None: each receiver gets it whole

    @property
    def tiles(self) -> int:
        return len(self.dst)

    @property
    def senders(self) -> tuple[int, ...]:
        """The sending device of each tile (tile j goes to `dst[j]`)."""
        return tuple(self.src[j % len(self.src)] for j in range(len(self.dst)))

    @property
    def tile_type(self) -> TensorType:
        """What one receiving device gets across."""
        if self.dim is None:
            return self.type
        shape = list(self.type.shape)
        shape[self.dim] //= self.tiles
        return TensorType(tuple(shape), self.type.dtype)

    @property
    def gathered(self) -> bool:
        """Whether the receiving sub-mesh all-gathers the tiles (more than one tile)."""
        return self.dim is not None and self.tiles > 1

    @property
    def bytes_across(self) -> int:
        """Bytes that cross between the meshes: M, or n·M for a tensor sent whole to each."""
        return self.tile_type.nbytes * self.tiles

    def sent_by(self, rank: int) -> list[tuple[int, int]]:
        """(tile index, receiving rank) of every tile global rank `rank` sends."""
        return [(j, d) for j, (s, d) in enumerate(zip(self.senders, self.dst)) if s == rank]

    def source_of(self, rank: int) -> tuple[int, int]:
        """(tile index, sending rank) of the tile global rank `rank` receives."""
        j = self.dst.index(rank)
        return j, self.senders[j]


def tile_transfer(ty: TensorType, src: Sequence[int], dst: Sequence[int]) -> TileTransfer:
    """The transfer of a `ty` tensor from sub-mesh `src` to sub-mesh `dst`: tiles along the
    first dimension the number of receiving devices divides."""
    src, dst = tuple(src), tuple(dst)
    if not src or not dst or set(src) & set(dst):
        raise ValueError(f"a cross-mesh transfer needs two disjoint, non-empty sub-meshes, got "
                         f"{list(src)} and {list(dst)}")
    n = len(dst)
    dim = next((d for d, size in enumerate(ty.shape) if size % n == 0 and size >= n), None)
    return TileTransfer(ty, src, dst, dim if n > 1 else None)
