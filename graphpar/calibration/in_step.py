"""Ops inside a step: the second half of `graphpar calibrate`.

An op timed alone in a loop finds its operands in the cache, its output buffer recycled by the
allocator, and the other ranks idle or in the same collective; inside a step it reads what
earlier ops wrote, allocates afresh, shares the memory system with the other ranks' work, and
its collectives wait for gloo's threads to wake. On the development CPU ops ran 1.8-2.8 times
their loop-fitted time in a step (docs/plan-quality.md). Alpa profiles every stage for this
reason; graphpar profiles a few calibration programs instead and folds what it finds into the
rates, so that every plan, of any model, is priced with it.

The calibration programs are GPTs (`CALIBRATION_MODELS`: other widths and lengths than the
plan-quality benchmark's models, which check the result) on a 1-D mesh of the calibrated ranks:
a training step under plans that use every collective kind a plan on such a mesh uses (data
parallel: gradient all-reduces; Megatron: activation all-reduces; ZeRO-3: all-gathers and
reduce-scatters) and decode steps of a model whose weights (118 MB) no cache holds, so that its
skinny matmuls stream them from memory with every rank doing the same at once. Each runs a few
steps with every node timed (`Compiled.time_steps(profile=True)`);
`graphpar.calibration.fit.fit_in_step` turns the nodes into one factor per op class and collective
kind and a dispatch time per node and per byte of results (the small training step, the same
nodes on tensors 36x smaller, tells the two apart).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from graphpar.calibration.plan_runs import NodeRow, PlanCase, capture_case, node_rows, solve_plan
from graphpar.cost.cluster import mesh_for
from graphpar.cost.communication import collective_terms
from graphpar.ir.cluster import Cluster
from graphpar.runtime.timing import trimmed_mean

__all__ = ["CALIBRATION_MODELS", "PROGRAMS", "QUICK_PROGRAMS", "ProgramProfile",
           "profile_programs"]

CALIBRATION_MODELS = {  # name -> (model, mode, config, batch)
    "train": ("gpt", "train",
              dict(vocab_size=768, seq_len=48, d_model=384, n_layers=2, n_heads=6), 8),
    # the same step at a width whose tensors are 36x smaller: the same nodes with little
    # memory each, so that the fit can tell time per node from time per byte
    "train-small": ("gpt", "train",
                    dict(vocab_size=768, seq_len=48, d_model=64, n_layers=2, n_heads=2), 8),
    "decode": ("gpt", "decode",
               dict(vocab_size=2048, seq_len=48, d_model=1024, n_layers=2, n_heads=8), 8),
}
PROGRAMS = (("train", "data"), ("train", "megatron"), ("train", "zero-3"),
            ("train-small", "data"), ("decode", "data"), ("decode", "megatron"))
QUICK_PROGRAMS = (("train", "megatron"), ("train-small", "data"), ("decode", "megatron"))
STEPS, WARMUP = 6, 2


@dataclass
class ProgramProfile:
    """One calibration program on the ranks: its nodes (priced by the loop-fitted cluster,
    measured in the step) and its measured step seconds."""

    mode: str  # its `CALIBRATION_MODELS` name
    plan: str
    rows: list[NodeRow]
    step_seconds: float  # measured: mean over timed steps (the slowest dropped) of the slowest
    # rank's time

    @property
    def name(self) -> str:
        return f"{self.mode}/{self.plan}"

    latency: dict[str, float] = field(default_factory=dict)  # per collective kind, the
    # loop-fitted latency per step that priced it

    @property
    def result_bytes(self) -> int:
        """Bytes of results of its priced compute nodes, on one device (the fresh memory a
        step allocates: `fit_in_step`'s per-byte dispatch)."""
        return sum(r.result_bytes for r in self.rows if r.predicted > 0 and not r.collective)

    def samples(self) -> list[tuple]:
        """Per node (class or kind, predicted, measured), a collective's with its prediction's
        (latency term, bandwidth term): what `fit_in_step` takes."""
        out: list[tuple] = []
        for r in self.rows:
            if r.collective and r.kind in self.latency:
                alpha = min(r.predicted, collective_terms(r.kind, r.group)[0]
                            * self.latency[r.kind])
                out.append((r.kind, r.predicted, r.measured, (alpha, r.predicted - alpha)))
            else:
                out.append((r.kind, r.predicted, r.measured))
        return out


def profile_programs(cluster: Cluster, ranks: int, *, quick: bool = False,
                     progress: Callable[[str], None] | None = None) -> list[ProgramProfile]:
    """Run the calibration programs (`QUICK_PROGRAMS` with `quick`) on `ranks` gloo ranks,
    priced by `cluster` (the loop-fitted one), every node timed."""
    mesh = mesh_for(str(ranks), cluster)
    cases: dict[str, PlanCase] = {}
    profiles = []
    for name, plan_name in QUICK_PROGRAMS if quick else PROGRAMS:
        if name not in cases:
            model, mode, config, batch = CALIBRATION_MODELS[name]
            cases[name] = capture_case(model, mode, batch=batch, config=config)
        case = cases[name]
        _, compiled = solve_plan(case, mesh, plan_name, memory_limit=None)
        times = compiled.time_steps(STEPS, WARMUP, args=case.args, profile=True)[-1]
        rows = node_rows(compiled, times)
        latency = {}
        for kind in {r.kind for r in rows if r.collective}:
            rate = cluster.collective_rate(kind)
            latency[kind] = rate.latency if rate else cluster.intra_node_latency
        profiles.append(ProgramProfile(name, plan_name, rows, trimmed_mean(times.step_seconds),
                                       latency))
        if progress:
            progress(f"in-step {name}/{plan_name}")
    return profiles

