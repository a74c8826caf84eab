"""The `slice-stages` pass' result: which stage every node runs in, on which sub-mesh.

Times are estimated by the cost model (never measured); memory is in bytes per device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
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


# What a layer's ILP solve gave, in the order a report lists them. Only the first two give a
# plan; without one, the DP leaves out the logical mesh for every stage of that layering.
OUTCOMES = {
    "optimal": "optimal",
    "time_limit_not_proven_optimal": "hit the time limit with a plan not proven optimal "
                                     "(kept)",
    "time_limit_no_plan": "hit the time limit before any plan",
    "infeasible": "infeasible (no plan fits the memory limit)",
    "failed": "failed (no plan)",
}
PLANNED = ("optimal", "time_limit_not_proven_optimal")
EXAMPLES = 3  # solves kept per outcome other than optimal, to say what happened


@dataclass(frozen=True)
class LayerSolve:
    """One layer's solve that was not proven optimal or gave no plan: where, and why."""

    outcome: str  # a key of OUTCOMES
    layer: int  # its index in the layering
    layering: str  # which clustering into layers it belongs to (slice-stages tries several)
    modules: tuple[str, ...]  # module paths of the layer's forward ops
    submesh: tuple[int, int] | None  # the sub-mesh that first asked for it (None: no DP)
    logical_mesh: tuple[int, ...]
    family: str | None  # the hand plan tried first, None: the ILP alone
    message: str  # the error, or the solver's status and optimality gap

    def describe(self) -> str:
        where = f"layer {self.layer}" + (f" of the {self.layering} layers" if self.layering
                                         else "")
        mods = (f" ({self.modules[0]}..{self.modules[-1]})" if len(self.modules) > 1
                else f" ({self.modules[0]})" if self.modules else "")
        sub = f" of sub-mesh {'x'.join(map(str, self.submesh))}" if self.submesh else ""
        how = f", {self.family} layouts" if self.family else ""
        return (f"{where}{mods} on logical mesh {'x'.join(map(str, self.logical_mesh))}"
                f"{sub}{how}: {OUTCOMES[self.outcome]}: {self.message}")

    def as_dict(self) -> dict:
        return {"outcome": self.outcome, "layer": self.layer, "layering": self.layering,
                "modules": list(self.modules),
                "submesh": "x".join(map(str, self.submesh)) if self.submesh else None,
                "logical_mesh": "x".join(map(str, self.logical_mesh)),
                "family": self.family, "message": self.message}


@dataclass(frozen=True)
class LayerSolves:
    """The stage search's per-layer ILP solves, counted by outcome (a key of OUTCOMES), the
    first few of each outcome but optimal (`LayerSolve`), and the logical meshes a solve gave
    no plan on."""

    counts: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(OUTCOMES, 0)))
    examples: tuple[LayerSolve, ...] = ()
    no_plan_on: tuple[str, ...] = ()  # logical meshes ("2x1", or "2x1 megatron"), in order

    @property
    def counted(self) -> int:
        return sum(self.counts.values())

    @property
    def all_optimal(self) -> bool:
        return self.counts["optimal"] == self.counted

    def add(self, outcome: str, example: LayerSolve | None = None) -> LayerSolves:
        """These counts with one more solve of `outcome` (and `example`, kept while its
        outcome has fewer than EXAMPLES)."""
        counts = dict(self.counts)
        counts[outcome] += 1
        examples, no_plan = self.examples, self.no_plan_on
        if example is not None:
            if sum(e.outcome == outcome for e in examples) < EXAMPLES:
                examples += (example,)
            mesh = "x".join(map(str, example.logical_mesh)) + (
                f" {example.family}" if example.family else "")
            if outcome not in PLANNED and mesh not in no_plan:
                no_plan += (mesh,)
        return replace(self, counts=MappingProxyType(counts), examples=examples,
                       no_plan_on=no_plan)

    def summary(self) -> str:
        """`12 ILP solves (counted): 10 optimal, 2 hit the time limit ...`."""
        parts = [f"{n} {OUTCOMES[k]}" for k, n in self.counts.items() if n]
        return f"{self.counted} ILP solves (counted): " + (", ".join(parts) or "none")

    def warning(self) -> str | None:
        """One line when some solve was not proven optimal or gave no plan, else None."""
        if self.all_optimal:
            return None
        parts = [f"{n} {OUTCOMES[k]}" for k, n in self.counts.items() if n and k != "optimal"]
        line = f"stage search: {', '.join(parts)}, of {self.counted} layer ILP solves (counted)"
        if self.no_plan_on:
            meshes = "mesh" if len(self.no_plan_on) == 1 else "meshes"
            line += (f"; logical {meshes} {', '.join(self.no_plan_on)} left out of every "
                     "layering with those layers")
        return line

    def as_dict(self) -> dict:
        return {"counted": self.counted, **self.counts, "no_plan_on": list(self.no_plan_on),
                "examples": [e.as_dict() for e in self.examples], "warning": self.warning()}


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
    layer_solves: LayerSolves = field(default_factory=LayerSolves)  # the same, by outcome

    def describe(self) -> str:
        """A table a person can read: one line per stage, then a warning and examples where
        a layer's solve was not proven optimal or gave no plan."""
        lines = [f"{len(self.stages)} stage(s), {self.microbatches} microbatches, step "
                 f"{format_seconds(self.est_step_seconds)} (estimated); search "
                 f"{self.dp_seconds:.2f} s, {self.layer_solves.summary()}"]
        for i, s in enumerate(self.stages):
            first, last = s.layers[0], s.layers[-1]
            lines.append(
                f"  stage {i}: layers {first}..{last}, sub-mesh {s.submesh[0]}x{s.submesh[1]}, "
                f"logical mesh {'x'.join(map(str, s.logical_mesh))}, "
                f"{format_seconds(s.est_seconds)}/microbatch est, {format_bytes(s.mem_bytes)}"
                "/device est")
        warning = self.layer_solves.warning()
        if warning:
            lines.append(f"warning: {warning}")
            lines += [f"  {e.describe()}" for e in self.layer_solves.examples]
        return "\n".join(lines)
