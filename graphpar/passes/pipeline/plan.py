"""The `slice-stages` pass' result: which stage every node runs in, on which sub-mesh.

Times are estimated by the cost model (never measured); memory is in bytes per device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from graphpar.ir.graph import Node
from graphpar.units import format_bytes, format_seconds


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage: a range of layers on a sub-mesh, sharded by the ILP on a logical
    mesh of that sub-mesh's devices."""

    layers: tuple[int, ...]  # cluster indices, in order
    modules: tuple[str, ...]  # module paths of its forward ops (for the report)
    submesh: tuple[int, int]  # physical (hosts, devices per host)
    logical_mesh: tuple[int, ...]  # the mesh its ILP sharded it on
    est_seconds: float  # t_intra per microbatch, forward + backward (+ sending its boundary)
    mem_bytes: int  # weights + optimizer state + stashed activations per device
    devices: tuple[int, ...] = ()  # the physical devices of its sub-mesh (node-major ids)


@dataclass(frozen=True)
class StagePlan:
    """Stages in pipeline order, the stage of every node of the training graph, and what the
    search estimated and spent."""

    stages: tuple[PipelineStage, ...] = ()
    stage_of: Mapping[Node, int] = field(default_factory=lambda: MappingProxyType({}))
    microbatches: int = 1
    est_step_seconds: float = 0.0  # sum(t_i) + (B - 1) * max(t_i), estimated
    dp_seconds: float = 0.0  # measured wall time of the whole stage search
    ilp_solves: int = 0

    def describe(self) -> str:
        """A table a person can read: one line per stage."""
        lines = [f"{len(self.stages)} stage(s), {self.microbatches} microbatches, step "
                 f"{format_seconds(self.est_step_seconds)} (estimated); search "
                 f"{self.dp_seconds:.2f} s, {self.ilp_solves} ILP solves"]
        for i, s in enumerate(self.stages):
            first, last = s.layers[0], s.layers[-1]
            lines.append(
                f"  stage {i}: layers {first}..{last}, sub-mesh {s.submesh[0]}x{s.submesh[1]}, "
                f"logical mesh {'x'.join(map(str, s.logical_mesh))}, "
                f"{format_seconds(s.est_seconds)}/microbatch est, {format_bytes(s.mem_bytes)}"
                "/device est")
        return "\n".join(lines)
