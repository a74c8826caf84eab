"""Tensor layouts on a device mesh: one placement per mesh axis, as in torch.distributed.tensor.

A placement says what a mesh axis does to a tensor:

- `Shard(d)`: tensor dim `d` is split into equal chunks along the axis;
- `Replicate()`: every device along the axis holds the same data;
- `Partial("sum")`: every device holds a partial value; the tensor is their sum
  (or avg / max / min).

A `Layout` is a tuple of placements, one per mesh axis. When several axes shard the
same tensor dim, the lower axis is the major one (chunk index = i0 * n1 + i1), exactly as
in torch.distributed.tensor and in Alpa's `S01`.

Two text forms, both round-tripping exactly:

- the IR form, one entry per mesh axis: `{S(0),R}`, `{P,S(1)}`, `{R,P(max)}`;
  `Layout.parse(text)` reads it back.
- Alpa's form, one entry per tensor dim: `S0R`, `RS1`, `S01R`, `RR`; partial axes
  follow a `|`: `RS1|P0`, `RR|P01`, `RR|P1(max)`. `layout.alpa(ndim)` and
  `Layout.from_alpa(text, mesh_ndim)`.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from graphpar.errors import ShardingError
from graphpar.ir.mesh import Mesh

__all__ = [
    "REDUCE_OPS",
    "Layout",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "all_layouts",
    "parse_placement",
]

REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Placement:
    """Base of `Shard`, `Replicate` and `Partial`. Frozen and hashable."""

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True)
class Shard(Placement):
    """Tensor dim `dim` is split into equal chunks along the mesh axis."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard(dim) needs a tensor dim >= 0, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every device along the mesh axis holds the whole (local) tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial(Placement):
    """Devices along the mesh axis hold partial values; the tensor is their `reduce_op`."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {REDUCE_OPS}, "
                             f"got {self.reduce_op!r}")

    def __str__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"


_PLACEMENT_RE = re.compile(r"S\((\d+)\)|R|P(?:\((\w+)\))?")


def parse_placement(text: str) -> Placement:
    """"S(0)" -> Shard(0), "R" -> Replicate(), "P" / "P(sum)" -> Partial(), "P(max)" -> ..."""
    m = _PLACEMENT_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text.strip()!r} is not a placement: expected S(<dim>), R, P or "
                         f"P(<op>) with op in {', '.join(REDUCE_OPS)}")
    if m.group(1) is not None:
        return Shard(int(m.group(1)))
    if text.strip() == "R":
        return Replicate()
    return Partial(m.group(2) or "sum")


def _axes_text(axes: Sequence[int]) -> str:
    if len(axes) == 1:
        return f"mesh axis {axes[0]}"
    return "mesh axes " + ", ".join(map(str, axes))


@dataclass(frozen=True)
class Layout:
    """One placement per mesh axis. Frozen and hashable; `str()` gives the IR form `{S(0),R}`."""

    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        placements = tuple(self.placements)
        if not placements:
            raise ValueError("a layout needs one placement per mesh axis, got none")
        for p in placements:
            if not isinstance(p, Placement) or type(p) is Placement:
                raise ValueError(f"layout entries must be Shard, Replicate or Partial, got {p!r}")
        object.__setattr__(self, "placements", placements)

    # ----------------------------------------------------------------- construction

    @classmethod
    def replicated(cls, mesh_ndim: int) -> Layout:
        """All-`Replicate` on a mesh with `mesh_ndim` axes."""
        return cls((Replicate(),) * mesh_ndim)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Read the IR form `{S(0),R}` (spaces allowed). Raises ValueError on bad text."""
        body = text.strip()
        if not (body.startswith("{") and body.endswith("}")):
            raise ValueError(f"layout {text!r} must be placements in braces, like {{S(0),R}}")
        entries = body[1:-1].split(",")
        placements = []
        for i, entry in enumerate(entries):
            try:
                placements.append(parse_placement(entry))
            except ValueError as e:
                raise ValueError(f"layout {text!r}, entry {i} (mesh axis {i}): {e}") from None
        return cls(tuple(placements))

    @classmethod
    def from_alpa(cls, text: str, mesh_ndim: int) -> Layout:
        """Read Alpa's notation (`S0R`, `RS01`, `RS1|P0`) for a mesh with `mesh_ndim` axes.

        Mesh axes named nowhere are `Replicate`. `S10` (axis 1 major) has no placement form
        and is rejected, as is an axis used twice.
        """
        m = re.fullmatch(r"((?:R|S\d+)*)((?:\|P\d+(?:\(\w+\))?)*)", text.strip())
        if m is None:
            raise ValueError(f"{text!r} is not Alpa notation: one R or S<axes> per tensor dim "
                             "(S0R, RS01), then optional |P<axes>[(op)] (RS1|P0)")
        placements: list[Placement | None] = [None] * mesh_ndim

        def claim(axis_digits: str, placement: Placement) -> None:
            axes = [int(c) for c in axis_digits]
            if axes != sorted(axes):
                raise ValueError(
                    f"{text!r}: S{axis_digits} shards with a minor axis before a major one; "
                    f"placements can only express ascending axes (S{''.join(sorted(axis_digits))})")
            for axis in axes:
                if axis >= mesh_ndim:
                    raise ValueError(f"{text!r} uses mesh axis {axis} but the mesh has "
                                     f"{mesh_ndim} axes")
                if placements[axis] is not None:
                    raise ValueError(f"{text!r} uses mesh axis {axis} twice")
                placements[axis] = placement

        for dim, token in enumerate(re.findall(r"R|S\d+", m.group(1))):
            if token != "R":
                claim(token[1:], Shard(dim))
        for digits, op in re.findall(r"\|P(\d+)(?:\((\w+)\))?", m.group(2)):
            if op and op not in REDUCE_OPS:
                raise ValueError(f"{text!r}: unknown reduce op {op!r}; use {REDUCE_OPS}")
            claim(digits, Partial(op or "sum"))
        return cls(tuple(p if p is not None else Replicate() for p in placements))

    @classmethod
    def from_torch(cls, placements: Sequence[object]) -> Layout:
        """From torch.distributed.tensor placements (Shard, Replicate, Partial)."""
        result: list[Placement] = []
        for p in placements:
            if type(p).__name__ == "Shard":
                result.append(Shard(int(p.dim)))  # type: ignore[attr-defined]
            elif type(p).__name__ == "Replicate":
                result.append(Replicate())
            elif type(p).__name__ == "Partial":
                result.append(Partial(str(p.reduce_op)))  # type: ignore[attr-defined]
            else:
                raise ValueError(f"placement {p!r} has no graphpar layout form")
        return cls(tuple(result))

    def to_torch(self) -> tuple[object, ...]:
        """The same layout as torch.distributed.tensor placements."""
        from torch.distributed.tensor import Partial as TPartial
        from torch.distributed.tensor import Replicate as TReplicate
        from torch.distributed.tensor import Shard as TShard

        out: list[object] = []
        for p in self.placements:
            if isinstance(p, Shard):
                out.append(TShard(p.dim))
            elif isinstance(p, Partial):
                out.append(TPartial(p.reduce_op))
            else:
                out.append(TReplicate())
        return tuple(out)

    # ----------------------------------------------------------------- text

    def __str__(self) -> str:
        return "{" + ",".join(map(str, self.placements)) + "}"

    def __repr__(self) -> str:
        return f"Layout.parse({str(self)!r})"

    def alpa(self, tensor_ndim: int) -> str:
        """Alpa's notation for a tensor with `tensor_ndim` dims: `S0R`, `RS01`, `RS1|P0`."""
        if self.mesh_ndim > 10:
            raise ValueError("Alpa notation names mesh axes by one digit: at most 10 axes")
        self._check_dims(tensor_ndim)
        dims = "".join(
            "S" + "".join(map(str, axes)) if (axes := self.shard_axes(d)) else "R"
            for d in range(tensor_ndim))
        by_op: dict[str, list[int]] = {}
        for axis, p in enumerate(self.placements):
            if isinstance(p, Partial):
                by_op.setdefault(p.reduce_op, []).append(axis)
        suffix = "".join(f"|P{''.join(map(str, axes))}" + ("" if op == "sum" else f"({op})")
                         for op, axes in by_op.items())
        return dims + suffix

    # ----------------------------------------------------------------- structure

    def __len__(self) -> int:
        return len(self.placements)

    def __iter__(self) -> Iterator[Placement]:
        return iter(self.placements)

    def __getitem__(self, axis: int) -> Placement:
        return self.placements[axis]

    @property
    def mesh_ndim(self) -> int:
        """The number of mesh axes this layout is for."""
        return len(self.placements)

    @property
    def is_replicated(self) -> bool:
        """Every mesh axis replicates: each device holds the whole tensor."""
        return all(isinstance(p, Replicate) for p in self.placements)

    @property
    def is_partial(self) -> bool:
        """Some mesh axis holds partial values (a reduction is pending)."""
        return any(isinstance(p, Partial) for p in self.placements)

    @property
    def is_sharded(self) -> bool:
        return any(isinstance(p, Shard) for p in self.placements)

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    @property
    def replicated_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Replicate))

    @property
    def sharded_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Shard))

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        """The tensor dims some mesh axis shards, ascending."""
        return tuple(sorted({p.dim for p in self.placements if isinstance(p, Shard)}))

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """The mesh axes that shard tensor dim `dim`, major (lowest) first; () if none."""
        return tuple(a for a, p in enumerate(self.placements) if p == Shard(dim))

    def dim_map(self) -> dict[int, tuple[int, ...]]:
        """{tensor dim: mesh axes sharding it (major first)} for every sharded dim."""
        return {d: self.shard_axes(d) for d in self.sharded_dims}

    def axis_dim(self, axis: int) -> int | None:
        """The tensor dim mesh axis `axis` shards, or None."""
        p = self.placements[axis]
        return p.dim if isinstance(p, Shard) else None

    def with_placement(self, axis: int, placement: Placement) -> Layout:
        """This layout with mesh axis `axis` set to `placement`."""
        placements = list(self.placements)
        placements[axis] = placement
        return Layout(tuple(placements))

    # ----------------------------------------------------------------- shapes

    def _check_dims(self, tensor_ndim: int) -> None:
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard) and p.dim >= tensor_ndim:
                raise ShardingError(
                    f"layout {self} shards tensor dim {p.dim} on mesh axis {axis}, but the "
                    f"tensor has {tensor_ndim} dim(s); shard a dim below {tensor_ndim}")

    def _check_mesh(self, mesh: Mesh) -> None:
        if mesh.ndim != self.mesh_ndim:
            raise ShardingError(f"layout {self} has {self.mesh_ndim} placement(s) but mesh "
                                f"{mesh} has {mesh.ndim} axes; give one placement per mesh axis")

    def num_shards(self, dim: int, mesh: Mesh) -> int:
        """How many chunks tensor dim `dim` is split into (1 if not sharded)."""
        return math.prod(mesh.shape[a] for a in self.shard_axes(dim))

    def check(self, global_shape: Sequence[int], mesh: Mesh) -> None:
        """Raise ShardingError unless this layout fits a tensor of `global_shape` on `mesh`."""
        self._check_mesh(mesh)
        self._check_dims(len(global_shape))
        for dim in self.sharded_dims:
            axes = self.shard_axes(dim)
            n = self.num_shards(dim, mesh)
            size = global_shape[dim]
            if size % n:
                sizes = "x".join(str(mesh.shape[a]) for a in axes)
                chunks = f"{n} chunks" if len(axes) == 1 else f"{sizes} = {n} chunks"
                raise ShardingError(
                    f"layout {self}: tensor dim {dim} of size {size} is sharded over "
                    f"{_axes_text(axes)} of mesh {mesh} ({chunks}), but {size} is "
                    f"not divisible by {n}; shard another dim, replicate this one, or use a "
                    f"mesh whose axis sizes divide {size}")

    def fits(self, global_shape: Sequence[int], mesh: Mesh) -> bool:
        """Whether `check` would pass."""
        try:
            self.check(global_shape, mesh)
        except ShardingError:
            return False
        return True

    def local_shape(self, global_shape: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
        """The shape each device holds. Raises ShardingError if a sharded dim does not divide."""
        self.check(global_shape, mesh)
        return tuple(size // self.num_shards(d, mesh) for d, size in enumerate(global_shape))

    def local_numel(self, global_shape: Sequence[int], mesh: Mesh) -> int:
        return math.prod(self.local_shape(global_shape, mesh))

    def local_bytes(self, global_shape: Sequence[int], dtype_bytes: int, mesh: Mesh) -> int:
        """Bytes each device holds: the per-device memory of this tensor."""
        return self.local_numel(global_shape, mesh) * dtype_bytes

    def local_slices(self, global_shape: Sequence[int], mesh: Mesh, device_id: int) \
            -> tuple[slice, ...]:
        """Which part of the global tensor device `device_id` holds (for a Partial axis, the
        part it holds a partial value of). Chunk index along a dim = row-major index of the
        device's coordinates on the axes sharding it, lower axes major."""
        local = self.local_shape(global_shape, mesh)
        coord = mesh.coordinate(device_id)
        slices = []
        for dim, size in enumerate(local):
            index = 0
            for axis in self.shard_axes(dim):
                index = index * mesh.shape[axis] + coord[axis]
            slices.append(slice(index * size, (index + 1) * size))
        return tuple(slices)


def all_layouts(global_shape: Sequence[int], mesh: Mesh, include_partial: bool = False) \
        -> list[Layout]:
    """Every layout that fits `global_shape` on `mesh`: each axis `Replicate`, `Shard(d)` for
    any dim (several axes may shard one dim), and optionally `Partial("sum")`. In a stable
    order, replicated first."""
    choices: list[Placement] = [Replicate()] + [Shard(d) for d in range(len(global_shape))]
    if include_partial:
        choices.append(Partial())
    result = []
    for combo in itertools.product(choices, repeat=mesh.ndim):
        layout = Layout(combo)
        if layout.fits(global_shape, mesh):
            result.append(layout)
    return result
