"""Pipeline stage programs as data: what the pipeline passes build and the pipeline runtime runs.

A microbatch training graph is cut into per-stage programs (forward F, backward B or its
input-gradient part I and weight-gradient part W, optimizer update U) that exchange tensors by
name (`graphpar.passes.pipeline.stage_programs.split_stages` builds them; docs/pipeline.md).
A token-sliced pipeline has such programs per token slice, beside the whole sequence's update
programs (`graphpar.passes.pipeline.token_programs.split_token_slices`; docs/token-slicing.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from graphpar.ir.graph import Graph, Node
from graphpar.ir.types import TensorType

__all__ = ["PHASES", "PipelinePrograms", "SlicePrograms", "StageProgram", "TokenPrograms"]

PHASES = ("F", "B", "I", "W", "U")


@dataclass
class StageProgram:
    """One stage's programs and the names it sends, stashes and accumulates."""

    stage: int
    forward: Graph | None
    backward: Graph | None  # the whole backward (GPipe, 1F1B)
    input_grad: Graph | None  # the backward split for zero-bubble schedules: I then W
    weight_grad: Graph | None
    update: Graph | None
    send_forward: tuple[str, ...] = ()
    send_backward: tuple[str, ...] = ()
    keep_after_forward: frozenset[str] = frozenset()  # what the microbatch's backward needs
    grads: tuple[str, ...] = ()

    def program(self, phase: str) -> Graph | None:
        return {"F": self.forward, "B": self.backward, "I": self.input_grad,
                "W": self.weight_grad, "U": self.update}[phase]

    def graphs(self) -> list[Graph]:
        return [g for p in PHASES if (g := self.program(p)) is not None]


@dataclass
class PipelinePrograms:
    """Every stage's programs for one microbatch training graph."""

    graph: Graph  # the training step at microbatch size
    stage_of: Mapping[Node, int]
    stages: tuple[StageProgram, ...]
    types: dict[str, TensorType] = field(default_factory=dict)  # every sent or kept name
    grad_transfers: tuple[tuple[int, int, str], ...] = ()  # (from stage, to stage, grad name)

    def bytes_sent(self, stage: int) -> tuple[int, int]:
        """(forward, backward) bytes stage `stage` sends per microbatch."""
        program = self.stages[stage]
        return (sum(self.types[n].nbytes for n in program.send_forward),
                sum(self.types[n].nbytes for n in program.send_backward))

    def step_bytes(self, microbatches: int) -> int:
        """Bytes sent between stages in one step of `microbatches` microbatches."""
        per_mb = sum(sum(self.bytes_sent(s)) for s in range(len(self.stages)))
        grads = sum(self.types[name].nbytes for _, _, name in self.grad_transfers)
        return per_mb * microbatches + grads


@dataclass
class SlicePrograms:
    """One token slice [offset, offset + length): its step's programs on every stage."""

    offset: int
    length: int
    programs: PipelinePrograms


@dataclass
class TokenPrograms:
    """Every slice's stage programs, and what the whole pipeline's updates read."""

    whole: PipelinePrograms  # the whole-sequence step: its graph's outputs and update programs
    slices: tuple[SlicePrograms, ...]
    grad_param: dict[str, str]  # an update program's gradient input -> the parameter's name
    grad_transfers: tuple[tuple[int, int, str], ...]  # (from stage, to stage, parameter)

    @property
    def stages(self) -> int:
        return len(self.whole.stages)

    @property
    def token_slices(self) -> list[int]:
        return [s.length for s in self.slices]

    def update(self, stage: int) -> Graph | None:
        return self.whole.stages[stage].update

    def item_bytes(self, j: int) -> int:
        """Bytes sent between stages for one microbatch's slice j (activations forward,
        gradients back), from its programs' transfer lists."""
        programs = self.slices[j].programs
        return sum(sum(programs.bytes_sent(s)) for s in range(self.stages))

    def step_bytes(self, microbatches: int) -> int:
        """Bytes sent between stages in one step: every slice of every microbatch, then the
        summed gradients that another stage updates."""
        per_mb = sum(self.item_bytes(j) for j in range(len(self.slices)))
        grads = 0
        for _, dst, param in self.grad_transfers:
            grad = next(n for n, p in self.grad_param.items() if p == param
                        and self.update(dst) is not None
                        and n in {v.name for v in self.update(dst).inputs})
            grads += self.whole.types[grad].nbytes
        return per_mb * microbatches + grads
