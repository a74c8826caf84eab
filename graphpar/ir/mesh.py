"""Device meshes: an N-d logical grid of devices with a bandwidth and a latency per axis.

A `Mesh` is what the sharding passes plan for (Alpa §4.1): devices laid out row-major
in an N-d grid; collectives run along one axis (or several) at a time, and all device
groups along one axis are assumed to communicate at the same speed. The axis
bandwidth (bytes/s, one direction, per device) and latency (seconds per step) feed the
alpha-beta cost model in `graphpar.cost.communication`.

    Mesh((2, 4))                              # abstract: bandwidth 1 B/s, latency 0
    Mesh.from_string("2x4", cluster)          # on a `Cluster`
    Mesh.from_cluster(cluster, (2, 8))        # axis 1 inside a node, axis 0 across nodes
    graphpar.cost.cluster.mesh_for("2x4", "dgx-a100")   # on a preset or cluster file

`Cluster` (re-exported here) describes the physical machine: see `graphpar.ir.cluster`.
A mesh built on a cluster keeps it (`mesh.cluster`): the IR prints both, so a sharded program
says what it was planned for.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from graphpar.errors import ShardingError
from graphpar.ir.cluster import Cluster
from graphpar.units import format_bandwidth, format_seconds

__all__ = ["Cluster", "Mesh", "parse_mesh_shape"]


def parse_mesh_shape(text: str | int | Sequence[int]) -> tuple[int, ...]:
    """"2x4" -> (2, 4); "8" -> (8,); "2x2x2" -> (2, 2, 2). Tuples and ints pass through."""
    if isinstance(text, int) and not isinstance(text, bool):
        shape: tuple[int, ...] = (text,)
    elif isinstance(text, str):
        parts = re.split(r"\s*[xX×,]\s*", text.strip())
        if not text.strip() or not all(p.isdigit() for p in parts):
            raise ShardingError(f"mesh {text!r} is not a shape like '8', '2x4' or '2x2x2'")
        shape = tuple(int(p) for p in parts)
    else:
        shape = tuple(text)
    if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                            for n in shape):
        raise ShardingError(f"mesh shape {text!r} must be one or more positive integers")
    return shape


def _per_axis(value: float | Sequence[float], ndim: int, what: str, default: float) \
        -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * ndim
    values = tuple(float(v) for v in value) if len(value) else (default,) * ndim
    if len(values) != ndim:
        raise ShardingError(f"mesh has {ndim} axes but {len(values)} {what} values: {value!r}")
    return values


@dataclass(frozen=True)
class Mesh:
    """An N-d logical device mesh. Frozen and hashable: use it as a cache key.

    - `shape`: devices per axis, e.g. (2, 4). Axis 0 is the major (slowest-varying) one.
    - `device_ids`: the devices in row-major order (default 0..size-1); device
      `device_ids[i]` sits at `np.unravel_index(i, shape)`.
    - `bandwidth`: bytes/s per axis, one direction, per device (default 1.0: an abstract
      mesh whose costs count bytes).
    - `latency`: seconds per message step per axis, the alpha (default 0.0).
    - `axis_names`: optional names, e.g. ("dp", "tp").
    - `cluster`: the machine the mesh is laid on, when it came from one (`from_cluster`).

    Scalars for `bandwidth` / `latency` apply to every axis.
    """

    shape: tuple[int, ...]
    device_ids: tuple[int, ...] = ()
    bandwidth: tuple[float, ...] = ()
    latency: tuple[float, ...] = ()
    axis_names: tuple[str, ...] | None = field(default=None)
    cluster: Cluster | None = None

    def __post_init__(self) -> None:
        shape = parse_mesh_shape(self.shape)
        size = math.prod(shape)
        ids = tuple(int(i) for i in self.device_ids) if len(self.device_ids) else tuple(range(size))
        if len(ids) != size:
            raise ShardingError(f"mesh {'x'.join(map(str, shape))} has {size} devices but "
                                f"{len(ids)} device ids were given")
        if len(set(ids)) != size or min(ids) < 0:
            raise ShardingError(f"mesh device ids must be distinct and >= 0, got {ids}")
        bandwidth = _per_axis(self.bandwidth, len(shape), "bandwidth", 1.0)
        latency = _per_axis(self.latency, len(shape), "latency", 0.0)
        if not all(b > 0 and math.isfinite(b) for b in bandwidth):
            raise ShardingError(f"mesh bandwidths must be positive bytes/s, got {bandwidth}")
        if not all(lat >= 0 and math.isfinite(lat) for lat in latency):
            raise ShardingError(f"mesh latencies must be >= 0 seconds, got {latency}")
        names = None
        if self.axis_names is not None:
            names = tuple(str(n) for n in self.axis_names)
            if len(names) != len(shape) or len(set(names)) != len(names):
                raise ShardingError(f"mesh {shape} needs {len(shape)} distinct axis names, "
                                    f"got {self.axis_names!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "bandwidth", bandwidth)
        object.__setattr__(self, "latency", latency)
        object.__setattr__(self, "axis_names", names)

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_string(cls, text: str, cluster: Cluster | None = None,
                    axis_names: Sequence[str] | None = None) -> Mesh:
        """A mesh from text like "2x4". With a `Cluster` it is mapped onto the cluster's first
        devices as in `from_cluster`; without one it is abstract (bandwidth 1 B/s, latency 0).
        Presets and cluster files are resolved by `graphpar.cost.cluster.mesh_for`."""
        shape = parse_mesh_shape(text)
        if cluster is None:
            return cls(shape, axis_names=tuple(axis_names) if axis_names else None)
        return cls.from_cluster(cluster, shape, axis_names=axis_names)

    @classmethod
    def from_cluster(cls, cluster: Cluster, shape: str | Sequence[int],
                     devices: Sequence[int] | None = None,
                     axis_names: Sequence[str] | None = None) -> Mesh:
        """Lay `shape` out row-major over `devices` of `cluster` (default: its first devices,
        which fill node 0 first) and give each axis the speed of the links it crosses.

        The rule: devices are numbered node-major, so the last (fastest-varying) mesh axes
        land inside a node. For each axis, look at its device groups (the devices that differ
        only in that axis' coordinate):

        - every group inside one node -> the axis gets the intra-node bandwidth and latency;
        - some group spans nodes -> the inter-node latency, and the bandwidth
          `min(intra, inter_node_bandwidth / k)`, where `k` is the largest number of the
          axis' groups that leave any one node. All groups of an axis run their collective
          at once (SPMD), so they share the node's NICs: on 2 nodes of 8, mesh 2x8 has 8
          groups of 2 on axis 0 and each gets 1/8 of the node bandwidth; mesh 16 has one
          group, which gets all of it (but no more than a device's intra-node link).

        So on 2 DGX A100s, `2x8` gives axis 1 300 GB/s (NVLink) and axis 0 25 GB/s (one HDR
        NIC per GPU); `4x4` gives axis 1 300 GB/s and axis 0 (groups of 4 spanning both
        nodes, 4 per node) 50 GB/s.
        """
        shape = parse_mesh_shape(shape)
        size = math.prod(shape)
        ids = tuple(range(size)) if devices is None else tuple(int(d) for d in devices)
        if len(ids) != size:
            raise ShardingError(f"mesh {'x'.join(map(str, shape))} needs {size} devices, "
                                f"{len(ids)} were given")
        if size > cluster.num_devices or any(not 0 <= d < cluster.num_devices for d in ids):
            raise ShardingError(
                f"mesh {'x'.join(map(str, shape))} needs {size} devices (ids {min(ids)}.."
                f"{max(ids)}) but cluster {cluster.name!r} has {cluster.num_devices} "
                f"({cluster.num_nodes} node(s) x {cluster.devices_per_node}); use a smaller mesh "
                "or more nodes (e.g. dataclasses.replace(cluster, num_nodes=...))")
        grid = np.array(ids).reshape(shape)
        bandwidth, latency = [], []
        for axis in range(len(shape)):
            groups = np.moveaxis(grid, axis, -1).reshape(-1, shape[axis])
            leaving: dict[int, int] = {}  # node -> how many groups of this axis leave it
            for group in groups:
                nodes = {cluster.node_of(int(d)) for d in group}
                if len(nodes) > 1:
                    for node in nodes:
                        leaving[node] = leaving.get(node, 0) + 1
            if not leaving:
                bandwidth.append(cluster.intra_node_bandwidth)
                latency.append(cluster.intra_node_latency)
            else:
                share = cluster.inter_node_bandwidth / max(leaving.values())
                bandwidth.append(min(cluster.intra_node_bandwidth, share))
                latency.append(cluster.inter_node_latency)
        return cls(shape, ids, tuple(bandwidth), tuple(latency),
                   tuple(axis_names) if axis_names else None, cluster)

    # ----------------------------------------------------------------- queries

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of devices."""
        return len(self.device_ids)

    def axis(self, axis: int | str) -> int:
        """The index of an axis given by index (negative allowed) or by name."""
        if isinstance(axis, str):
            if self.axis_names is None or axis not in self.axis_names:
                raise ShardingError(f"mesh {self} has no axis named {axis!r} "
                                    f"(axes: {self.axis_names or 'unnamed'})")
            return self.axis_names.index(axis)
        if not -self.ndim <= axis < self.ndim:
            raise ShardingError(f"mesh {self} has no axis {axis} (it has {self.ndim})")
        return axis % self.ndim

    def axes(self, axes: int | str | Sequence[int | str]) -> tuple[int, ...]:
        """Normalize one axis or several to a tuple of distinct axis indices."""
        if isinstance(axes, (int, str)):
            return (self.axis(axes),)
        result = tuple(self.axis(a) for a in axes)
        if not result or len(set(result)) != len(result):
            raise ShardingError(f"mesh axes {axes!r} must be one or more distinct axes")
        return result

    def group_size(self, axes: int | str | Sequence[int | str]) -> int:
        """How many devices take part in a collective along `axes`."""
        return math.prod(self.shape[a] for a in self.axes(axes))

    def group_bandwidth(self, axes: int | str | Sequence[int | str]) -> float:
        """Bandwidth of a collective along `axes`: the slowest of those axes."""
        return min(self.bandwidth[a] for a in self.axes(axes))

    def group_latency(self, axes: int | str | Sequence[int | str]) -> float:
        """Latency (alpha) of a collective along `axes`: the largest of those axes."""
        return max(self.latency[a] for a in self.axes(axes))

    def coordinate(self, device_id: int) -> tuple[int, ...]:
        """The mesh coordinate of a device."""
        try:
            index = self.device_ids.index(device_id)
        except ValueError:
            raise ShardingError(f"device {device_id} is not in mesh {self}") from None
        return tuple(int(c) for c in np.unravel_index(index, self.shape))

    def device_at(self, coordinate: Sequence[int]) -> int:
        """The device at a mesh coordinate."""
        return self.device_ids[int(np.ravel_multi_index(tuple(coordinate), self.shape))]

    def groups(self, axes: int | str | Sequence[int | str]) -> tuple[tuple[int, ...], ...]:
        """The device groups of a collective along `axes`: devices that agree on every other
        coordinate, ordered row-major over `axes` in the order given. For 2x4 = [[0,1,2,3],
        [4,5,6,7]]: groups(1) = ((0,1,2,3), (4,5,6,7)), groups(0) = ((0,4), (1,5), (2,6),
        (3,7)), groups((0, 1)) = ((0,...,7),)."""
        ax = self.axes(axes)
        rest = [a for a in range(self.ndim) if a not in ax]
        grid = np.array(self.device_ids).reshape(self.shape).transpose(rest + list(ax))
        n = math.prod(self.shape[a] for a in ax)
        return tuple(tuple(int(d) for d in g) for g in grid.reshape(-1, n))

    def group_of(self, device_id: int, axes: int | str | Sequence[int | str]) -> tuple[int, ...]:
        """The group along `axes` that contains `device_id`."""
        for group in self.groups(axes):
            if device_id in group:
                return group
        raise ShardingError(f"device {device_id} is not in mesh {self}")

    def __str__(self) -> str:
        return "x".join(map(str, self.shape))

    def describe(self) -> str:
        """One line per axis: size, name, bandwidth and latency."""
        lines = [f"mesh {self} ({self.size} devices)"]
        for a, n in enumerate(self.shape):
            name = f" ({self.axis_names[a]})" if self.axis_names else ""
            lines.append(f"  axis {a}{name}: {n} devices, {format_bandwidth(self.bandwidth[a])}, "
                         f"{format_seconds(self.latency[a])} latency")
        return "\n".join(lines)
