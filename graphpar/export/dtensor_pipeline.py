"""`--to dtensor --pipeline`: the stage plan in torch.distributed.pipelining's and torchtitan's
vocabulary, and `apply_pipeline`, which builds the stages and the schedule from it.

`pipeline_plan` says, per stage, its ranks and sub-mesh, the modules whose parameters it holds
(torchtitan's `module_fqns_per_model_part`), where it begins (the module of the first node that
reads one of its parameters: a `SplitPoint.BEGINNING` for `torch.distributed.pipelining`), and
its parameters' placements on its sub-mesh; then the schedule class, the microbatches and the
degrees. `torchtitan_toml` writes the `[parallelism]` section torchtitan reads.
`apply_pipeline` splits the user's module at those points with `torch.distributed.pipelining`
and returns this rank's `PipelineStage` and the schedule; the stages' own sharding on their
sub-meshes is in the plan but not applied by it (each rank of a sub-mesh runs its stage whole,
replicas of one another).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphpar.errors import ShardingError, UsageError
from graphpar.ir.graph import Role

__all__ = ["SCHEDULE_CLASSES", "apply_pipeline", "pipeline_plan", "torchtitan_toml"]

# graphpar's schedule -> (torch.distributed.pipelining's class, torchtitan's name)
SCHEDULE_CLASSES = {"gpipe": ("ScheduleGPipe", "GPipe"), "1f1b": ("Schedule1F1B", "1F1B"),
                    "zb": ("ScheduleInterleavedZeroBubble", "InterleavedZeroBubble")}


def pipeline_plan(pipe, meshes: Sequence[Any], batch: int) -> dict:
    """plan.json's `pipeline` section for `pipe` (a `PipelineCompiled` sharded as planned,
    its stages on `meshes`), whose full batch has `batch` rows."""
    from graphpar.export.dtensor_plan import _placements

    programs = pipe.programs
    params = {v.name for v in programs.graph.inputs_with_role(Role.PARAM)}
    stages = []
    for program, mesh in zip(programs.stages, meshes):
        s = program.stage
        held = [v.name for v in program.forward.inputs if v.name in params]
        modules = list(dict.fromkeys(name.rpartition(".")[0] for name in held))
        first = next((n for n in programs.graph.nodes if programs.stage_of.get(n) == s
                      and any(v.name in params for v in n.input_values)), None)
        sharded = pipe.sharded.get(s, {}).get("F")
        layouts = ({v.name: v.layout for v in sharded.device_program.inputs}
                   if sharded is not None else {})
        stages.append({
            "ranks": list(mesh.device_ids), "mesh": list(mesh.shape),
            "module_fqns": modules,
            "split_before": (first.module if first is not None and s > 0 else None),
            "parameters": {n: _placements(layouts.get(n), len(mesh.shape)) for n in held}})
    name, titan = SCHEDULE_CLASSES[pipe.schedule_name]
    sizes = {len(st["ranks"]) for st in stages}
    return {"stages": stages, "schedule": name, "torchtitan_schedule": titan,
            "microbatches": pipe.microbatches, "microbatch_size": batch // pipe.microbatches,
            "degrees": {"pp": len(stages),
                        "tp": sizes.pop() if len(sizes) == 1 else None}}


def torchtitan_toml(pipeline: dict) -> str:
    """The `[parallelism]` section of a torchtitan job config for this pipeline."""
    parts = ", ".join("[" + ", ".join(f'"{m}"' for m in st["module_fqns"]) + "]"
                      for st in pipeline["stages"])
    lines = ["# written by graphpar export: the stage plan in torchtitan's words",
             "[parallelism]",
             f"pipeline_parallel_degree = {pipeline['degrees']['pp']}",
             f'pipeline_parallel_schedule = "{pipeline["torchtitan_schedule"]}"',
             f"pipeline_parallel_microbatch_size = {pipeline['microbatch_size']}",
             f"module_fqns_per_model_part = [{parts}]"]
    if pipeline["degrees"]["tp"]:
        lines.append(f"tensor_parallel_degree = {pipeline['degrees']['tp']}")
    return "\n".join(lines) + "\n"


def apply_pipeline(module: torch.nn.Module, plan: dict | str, microbatch_args: Sequence[Any],
                   loss_fn: Callable | None = None, device: torch.device | str = "cpu"):
    """This rank's `PipelineStage` of `module` split as `plan` (plan.json's dict or path)
    says, and the plan's `torch.distributed.pipelining` schedule over it: `(stage, schedule)`.

    Every rank calls it (it makes the process groups: the ranks at the same position of each
    stage's sub-mesh form one pipeline). `microbatch_args` are one microbatch's inputs, for
    tracing; `loss_fn(output, target)` is the loss the last stage computes."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    from graphpar.export.dtensor_plan import read_plan

    plan = read_plan(plan) if not isinstance(plan, dict) else plan
    pipeline = plan.get("pipeline")
    if not pipeline:
        raise UsageError("this plan has no pipeline: export it with --pipeline")
    stages = pipeline["stages"]
    world = sum(len(st["ranks"]) for st in stages)
    if dist.get_world_size() != world:
        raise ShardingError(f"the plan's {len(stages)} stages run on {world} ranks, this job "
                            f"has {dist.get_world_size()}: torchrun --nproc-per-node {world}")
    size = len(stages[0]["ranks"])
    if any(len(st["ranks"]) != size for st in stages):
        raise ShardingError("apply_pipeline needs sub-meshes of one size (one pipeline per "
                            "position on them)")
    rank = dist.get_rank()
    index = next(s for s, st in enumerate(stages) if rank in st["ranks"])
    position = stages[index]["ranks"].index(rank)
    group = None
    for p in range(size):  # every rank makes every pipeline's group, in the same order
        made = dist.new_group([st["ranks"][p] for st in stages])
        if p == position:
            group = made
    names = dict(module.named_modules())
    split = {}
    for st in stages[1:]:
        if st["split_before"] not in names:
            raise ShardingError(f"plan: stage begins at module {st['split_before']!r}, which "
                                f"is not in the module ({type(module).__name__})")
        split[st["split_before"]] = pipelining.SplitPoint.BEGINNING
    pipe = pipelining.pipeline(module, mb_args=tuple(microbatch_args), split_spec=split)
    stage = pipe.build_stage(index, torch.device(device), group)
    schedule_class = getattr(pipelining, pipeline["schedule"])
    schedule = schedule_class(stage, n_microbatches=pipeline["microbatches"], loss_fn=loss_fn)
    return stage, schedule
