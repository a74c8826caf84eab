"""The hardware a mesh is laid on: nodes of identical devices, their links and peak rates.

A `Cluster` is plain data that the IR carries in its `cluster @name = {...}` declaration, so a
sharded program says what it was costed on. Named presets and cluster files are read by
`graphpar.cost.cluster`; `graphpar.ir.mesh.Mesh.from_cluster` derives mesh axes from one.

Devices are numbered node-major: device `i` sits on node `i // devices_per_node`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphpar.errors import ClusterSpecError
from graphpar.units import format_bandwidth, format_bytes, format_flops, format_seconds

__all__ = ["Cluster", "normalize_dtype"]

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

    def describe(self) -> str:
        """A few lines for people: shape, links, memory, peak rates."""
        return "\n".join([
            f"cluster {self.name}: {self.num_nodes} node(s) x {self.devices_per_node} "
            f"{self.device or 'device'}(s) = {self.num_devices} devices",
            f"  intra-node: {format_bandwidth(self.intra_node_bandwidth)} per device, "
            f"{format_seconds(self.intra_node_latency)} latency",
            f"  inter-node: {format_bandwidth(self.inter_node_bandwidth)} per node, "
            f"{format_seconds(self.inter_node_latency)} latency",
            f"  memory: {format_bytes(self.device_memory, binary=True)} per device",
            f"  peak: fp32 {format_flops(self.peak_flops_fp32)}, "
            f"fp16 {format_flops(self.peak_flops_fp16)}, bf16 {format_flops(self.peak_flops_bf16)}",
        ])

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
            "source": self.source,
        }
