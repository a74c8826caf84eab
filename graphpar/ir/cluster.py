"""The hardware a mesh is laid on: nodes of identical devices, their links and peak rates.

A `Cluster` is plain data that the IR carries in its `cluster @name = {...}` declaration, so a
sharded program says what it was costed on. Named presets and cluster files are read by
`graphpar.cost.cluster`; `graphpar.ir.mesh.Mesh.from_cluster` derives mesh axes from one.

Devices are numbered node-major: device `i` sits on node `i // devices_per_node`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from graphpar.errors import ClusterSpecError
from graphpar.units import format_bandwidth, format_bytes, format_flops, format_seconds

__all__ = ["CLUSTER_DTYPES", "COLLECTIVE_KINDS", "COMPUTE_CLASSES", "Cluster", "CollectiveRate",
           "ComputeRate", "normalize_dtype"]

# The op classes a compute table prices (`graphpar.cost.compute` says which op is which).
COMPUTE_CLASSES = ("gemm", "gemm_skinny", "elementwise", "normalization", "attention", "gather")
# The collectives a cluster may give measured alpha-beta numbers for.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                    "send_recv")
CLUSTER_DTYPES = ("fp32", "fp16", "bf16")  # the dtypes a cluster gives rates for


class ComputeRate(NamedTuple):
    """What one device achieves on one op class: FLOP/s, bytes/s of memory traffic, and
    seconds per call (launch and dispatch)."""

    flops: float
    bandwidth: float
    overhead: float


class CollectiveRate(NamedTuple):
    """A measured alpha-beta fit of one collective kind inside a node: seconds per message step
    and bytes/s, in the ring formulas of `graphpar.cost.communication`."""

    latency: float
    bandwidth: float

# The dtype names a cluster gives peak rates for, and the spellings accepted for each.
_DTYPE_ALIASES = {
    "fp32": "fp32", "f32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "f16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}


def normalize_dtype(dtype: object) -> str:
    """"fp32" / "f32" / "float32" / torch.float32 -> "fp32" (likewise fp16, bf16)."""
    key = str(dtype).lower()
    try:
        return _DTYPE_ALIASES[key]
    except KeyError:
        raise ValueError(f"no peak FLOP/s for dtype {dtype!r}; clusters give fp32, fp16 and bf16")\
            from None


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster: `num_nodes` nodes of `devices_per_node` identical devices.

    Units: bandwidths in bytes/s, one direction; latencies in seconds; memory in bytes;
    peak rates in FLOP/s (dense, no sparsity).

    - `intra_node_bandwidth`: what one device can send to the others in its node
      (NVLink/NVSwitch per GPU), per direction.
    - `inter_node_bandwidth`: what one node can send to other nodes, all of its NICs
      together, per direction (DGX A100: 8 NICs x 200 Gb/s = 200 GB/s). A mesh axis
      whose device groups cross nodes shares this among the groups leaving a node;
      see `graphpar.ir.mesh.Mesh.from_cluster`.
    - `*_latency`: the alpha of the alpha-beta model, per message step.
    """

    name: str
    num_nodes: int
    devices_per_node: int
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    device_memory: int
    peak_flops_fp32: float
    peak_flops_fp16: float
    peak_flops_bf16: float
    device: str = ""
    # Achieved rates per (dtype, op class): rows (dtype, class, flops, bandwidth, overhead),
    # sorted. Empty or partial: `compute_rate` falls back to the peak FLOP/s (see there).
    # A mapping {dtype: {class: {"flops", "bandwidth", "overhead"}}} is accepted too.
    compute: tuple[tuple[str, str, float, float, float], ...] = ()
    # Measured alpha-beta per collective kind on intra-node axes: rows (kind, latency,
    # bandwidth), sorted; a mapping {kind: {"latency", "bandwidth"}} is accepted too.
    collectives: tuple[tuple[str, float, float], ...] = ()
    # Seconds a node pays per byte of its results inside a step beyond its roofline time:
    # fresh memory allocated, first touched (page faults) and freed around the call, which an
    # op timed in a loop on a recycled buffer does not see (`graphpar calibrate` fits it).
    seconds_per_result_byte: float = 0.0
    # Where the numbers come from: documentation, not part of what the cluster is.
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for f in ("num_nodes", "devices_per_node", "device_memory"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterSpecError(
                    f"cluster {self.name!r}: field {f!r} must be a positive integer, got {value!r}")
        for f in ("intra_node_bandwidth", "inter_node_bandwidth",
                  "peak_flops_fp32", "peak_flops_fp16", "peak_flops_bf16"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ClusterSpecError(
                    f"cluster {self.name!r}: field {f!r} must be a positive number, got {value!r}")
            object.__setattr__(self, f, float(value))
        for f in ("intra_node_latency", "inter_node_latency"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ClusterSpecError(
                    f"cluster {self.name!r}: field {f!r} must be a number >= 0 (seconds), "
                    f"got {value!r}")
            object.__setattr__(self, f, float(value))
        value = self.seconds_per_result_byte
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ClusterSpecError(f"cluster {self.name!r}: field 'seconds_per_result_byte' "
                                   f"must be a number >= 0, got {value!r}")
        object.__setattr__(self, "seconds_per_result_byte", float(value))
        object.__setattr__(self, "compute", self._compute_rows(self.compute))
        object.__setattr__(self, "collectives", self._collective_rows(self.collectives))

    def _bad(self, field_name: str, why: str) -> ClusterSpecError:
        return ClusterSpecError(f"cluster {self.name!r}: field {field_name!r}: {why}")

    def _rate(self, field_name: str, where: str, value: object, zero_ok: bool) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                or not (value >= 0 if zero_ok else value > 0):
            raise self._bad(field_name, f"{where} must be a number {'>= 0' if zero_ok else '> 0'},"
                                        f" got {value!r}")
        return float(value)

    def _compute_rows(self, table: object) -> tuple:
        if isinstance(table, Mapping):  # {dtype: {class: {flops, bandwidth, overhead}}}
            rows = []
            for dtype, classes in table.items():
                if not isinstance(classes, Mapping):
                    raise self._bad("compute", f"{dtype}: expected an object of op classes, "
                                               f"got {classes!r}")
                for name, rate in classes.items():
                    if not isinstance(rate, Mapping) or set(rate) != set(ComputeRate._fields):
                        raise self._bad("compute", f"{dtype}.{name}: expected "
                                        '{"flops": ..., "bandwidth": ..., "overhead": ...}, '
                                        f"got {rate!r}")
                    rows.append((dtype, name, *(rate[k] for k in ComputeRate._fields)))
            table = rows
        out = {}
        for row in table:  # type: ignore[union-attr]
            if not isinstance(row, (tuple, list)) or len(row) != 5:
                raise self._bad("compute", "rows are (dtype, class, flops, bandwidth, overhead), "
                                f"got {row!r}")
            try:
                dtype = normalize_dtype(row[0])
            except ValueError:
                raise self._bad("compute", f"unknown dtype {row[0]!r}; give fp32, fp16 or bf16") \
                    from None
            if row[1] not in COMPUTE_CLASSES:
                raise self._bad("compute", f"unknown op class {row[1]!r}; the classes are "
                                           f"{', '.join(COMPUTE_CLASSES)}")
            where = f"{dtype}.{row[1]}"
            if (dtype, row[1]) in out:
                raise self._bad("compute", f"{where} is given twice")
            out[dtype, row[1]] = (dtype, row[1],
                                  self._rate("compute", where + ".flops", row[2], False),
                                  self._rate("compute", where + ".bandwidth", row[3], False),
                                  self._rate("compute", where + ".overhead", row[4], True))
        return tuple(out[k] for k in sorted(out))

    def _collective_rows(self, table: object) -> tuple:
        if isinstance(table, Mapping):  # {kind: {latency, bandwidth}}
            rows = []
            for kind, rate in table.items():
                if not isinstance(rate, Mapping) or set(rate) != set(CollectiveRate._fields):
                    raise self._bad("collectives", f"{kind}: expected "
                                    f'{{"latency": ..., "bandwidth": ...}}, got {rate!r}')
                rows.append((kind, rate["latency"], rate["bandwidth"]))
            table = rows
        out = {}
        for row in table:  # type: ignore[union-attr]
            if not isinstance(row, (tuple, list)) or len(row) != 3:
                raise self._bad("collectives", f"rows are (kind, latency, bandwidth), got {row!r}")
            if row[0] not in COLLECTIVE_KINDS:
                raise self._bad("collectives", f"unknown collective {row[0]!r}; the kinds are "
                                               f"{', '.join(COLLECTIVE_KINDS)}")
            if row[0] in out:
                raise self._bad("collectives", f"{row[0]} is given twice")
            out[row[0]] = (row[0], self._rate("collectives", row[0] + ".latency", row[1], True),
                           self._rate("collectives", row[0] + ".bandwidth", row[2], False))
        return tuple(out[k] for k in sorted(out))

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def node_of(self, device_id: int) -> int:
        """The node that holds device `device_id` (devices are numbered node-major)."""
        if not 0 <= device_id < self.num_devices:
            raise ValueError(f"device {device_id} is not in cluster {self.name!r} "
                             f"({self.num_devices} devices)")
        return device_id // self.devices_per_node

    def peak_flops(self, dtype: object) -> float:
        """Peak dense FLOP/s of one device for "fp32", "fp16", "bf16" (or a torch dtype)."""
        return float(getattr(self, "peak_flops_" + normalize_dtype(dtype)))

    def compute_rate(self, dtype: object, op_class: str) -> ComputeRate:
        """The achieved rates of one device on `op_class` at `dtype`. A class the table lacks
        gets the peak FLOP/s with no memory term and no overhead (the FLOP-only model)."""
        dtype = normalize_dtype(dtype)
        for row in self.compute:
            if row[0] == dtype and row[1] == op_class:
                return ComputeRate(*row[2:])
        if op_class not in COMPUTE_CLASSES:
            raise ValueError(f"unknown op class {op_class!r}; the classes are "
                             f"{', '.join(COMPUTE_CLASSES)}")
        return ComputeRate(self.peak_flops(dtype), math.inf, 0.0)

    def missing_compute(self) -> list[str]:
        """The "dtype.class" entries the compute table lacks (they fall back to peak)."""
        given = {(r[0], r[1]) for r in self.compute}
        return [f"{d}.{c}" for d in CLUSTER_DTYPES for c in COMPUTE_CLASSES if (d, c) not in given]

    def collective_rate(self, kind: object) -> CollectiveRate | None:
        """The measured alpha-beta of collective `kind` inside a node, or None (use the links)."""
        for row in self.collectives:
            if row[0] == str(kind):
                return CollectiveRate(*row[1:])
        return None

    def compute_table(self) -> dict[str, dict[str, dict[str, float]]]:
        """The compute table in the cluster-file form {dtype: {class: {flops, bandwidth,
        overhead}}}: only what the cluster gives."""
        table: dict[str, dict[str, dict[str, float]]] = {}
        for dtype, name, *rate in self.compute:
            table.setdefault(dtype, {})[name] = dict(zip(ComputeRate._fields, rate))
        return table

    def describe(self) -> str:
        """A few lines for people: shape, links, memory, peak and achieved rates."""
        lines = [
            f"cluster {self.name}: {self.num_nodes} node(s) x {self.devices_per_node} "
            f"{self.device or 'device'}(s) = {self.num_devices} devices",
            f"  intra-node: {format_bandwidth(self.intra_node_bandwidth)} per device, "
            f"{format_seconds(self.intra_node_latency)} latency",
            f"  inter-node: {format_bandwidth(self.inter_node_bandwidth)} per node, "
            f"{format_seconds(self.inter_node_latency)} latency",
            f"  memory: {format_bytes(self.device_memory, binary=True)} per device",
            f"  peak: fp32 {format_flops(self.peak_flops_fp32)}, "
            f"fp16 {format_flops(self.peak_flops_fp16)}, bf16 {format_flops(self.peak_flops_bf16)}",
        ]
        for dtype, classes in self.compute_table().items():
            lines.append(f"  achieved {dtype}: " + ", ".join(
                f"{name} {format_flops(r['flops'])} {format_bandwidth(r['bandwidth'])} "
                f"+{format_seconds(r['overhead'])}" for name, r in classes.items()))
        if self.seconds_per_result_byte:
            lines.append(f"  in a step: {self.seconds_per_result_byte * 2**20 * 1e6:.1f} us "
                         "per MiB of a node's results")
        if self.collectives:
            lines.append("  collectives (intra-node): " + ", ".join(
                f"{kind} {format_bandwidth(bw)} {format_seconds(lat)}"
                for kind, lat, bw in self.collectives))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The cluster as a JSON-able dict in the cluster-file format (numbers in base units)."""
        return {
            "name": self.name,
            "device": self.device,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device_memory": self.device_memory,
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "intra_node_latency": self.intra_node_latency,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "inter_node_latency": self.inter_node_latency,
            "peak_flops": {"fp32": self.peak_flops_fp32, "fp16": self.peak_flops_fp16,
                           "bf16": self.peak_flops_bf16},
            **({"compute": self.compute_table()} if self.compute else {}),
            **({"collectives": {kind: {"latency": lat, "bandwidth": bw}
                                for kind, lat, bw in self.collectives}}
               if self.collectives else {}),
            **({"seconds_per_result_byte": self.seconds_per_result_byte}
               if self.seconds_per_result_byte else {}),
            "source": self.source,
        }
