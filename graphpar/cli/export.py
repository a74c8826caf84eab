"""`graphpar export`: a plan handed to PyTorch: a torch program, DTensor placements, torch-mlir."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from graphpar.cli.common import (
    _existing_parent,
    add_model_options,
    add_pipeline_options,
    add_plan_options,
    auto_shard_pass,
    check_plan_options,
    load_target,
    publish_report,
    staged_output,
    step,
)
from graphpar.errors import OutputError, UsageError

FORMATS = ("torch", "dtensor", "mlir")


def add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="hand a plan to PyTorch: a standalone per-rank torch "
                                      "program, DTensor placements, or torch-mlir stages")
    add_model_options(e)
    e.add_argument("--to", required=True, metavar="|".join(FORMATS),
                   help="torch: program.py for torchrun (imports torch only); dtensor: "
                        "plan.json for graphpar.export.apply_plan; mlir: each stage graph in "
                        "torch-mlir's torch dialect")
    e.add_argument("--out", required=True, help="output directory (new or empty)")
    e.add_argument("--passes", default="cleanup", help="pipeline before auto-shard, as for "
                                                       "compile")
    add_plan_options(e, "the device mesh to plan on, e.g. 2x2 (2-D) or 4 (1-D); required")
    add_pipeline_options(e, "slice the training step into pipeline stages on sub-meshes of "
                            "--mesh, as compile does: 'auto' or a number of stages")
    e.set_defaults(fn=cmd_export, trace=None)


def check_export_options(args: argparse.Namespace) -> None:
    """Usage errors, found before the model is loaded."""
    if args.to not in FORMATS:
        raise UsageError(f"--to {args.to}: unknown format; give one of {', '.join(FORMATS)}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory; give a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"--out {out} exists and is not empty; give a new or empty directory "
                         "(export never mixes its files with others)")
    if not _existing_parent(out).is_dir():
        raise OutputError(f"{out}: cannot write --out there: a path component is a file")
    if not args.mesh:
        raise UsageError("export needs --mesh: the device mesh to plan on, e.g. --mesh 2x2")
    check_plan_options(args)
    if args.token_slices is not None:
        raise UsageError("--token-slices: token-sliced pipelines are not exported yet; export "
                         "the pipeline without it")
    if args.pipeline:
        from graphpar.cli.pipeline import check_pipeline_options

        check_pipeline_options(args)
    if args.to == "mlir":
        from graphpar.export.mlir import require_torch_mlir

        require_torch_mlir()


def cmd_export(args: argparse.Namespace) -> int:
    from graphpar.passes import parse_pipeline

    check_export_options(args)
    passes = parse_pipeline(args.passes)
    out = Path(args.out)
    with staged_output(out) as staging:
        if args.pipeline:
            summary = _export_pipeline(args, passes, staging)
        else:
            summary = _export_spmd(args, passes, staging)
        publish_report(summary, staging, out)
    print(f"graphpar export: {summary['model']} ({summary['mode']}) on mesh {args.mesh} "
          f"--to {args.to}")
    for line in summary.get("lines", []):
        print(f"  {line}")
    print(f"  wrote      {', '.join(str(out / f) for f in summary['files'])}")
    return 0


def _export_spmd(args: argparse.Namespace, passes: list, staging: Path) -> dict:
    """Auto-shard the model on --mesh and write the chosen format into `staging`."""
    from graphpar.capture.optim import optimizer_from_name
    from graphpar.compiler.api import lower
    from graphpar.compiler.driver import compile_model

    auto_shard = auto_shard_pass(args)
    with step("loading the model"):
        spec = load_target(args.model, args.example, args.mode)
    optimizer = optimizer_from_name(args.optimizer) if args.mode == "train" else None
    with step(f"capturing and planning {spec.name} ({args.mode}) on mesh {args.mesh}"):
        result = compile_model(spec, args.mode, [*passes, auto_shard], optimizer=optimizer,
                               on_pass=lambda p, i, n: None)
        compiled = lower(result.captured, result.context, spec=result.spec,
                         optimizer=result.optimizer)
    summary = {"model": spec.name, "mode": args.mode, "mesh": list(compiled.mesh.shape),
               "format": args.to}
    if args.to == "torch":
        from graphpar.export.torch_program import write_spmd_program

        with step("writing the torch program"):
            write_spmd_program(compiled.spmd, compiled.graph, compiled.mesh,
                               compiled.captured.state, staging, spec.name)
        summary["launch"] = (f"torchrun --nproc-per-node {compiled.mesh.size} program.py "
                             "--inputs IN.pt --outputs OUT.pt")
        summary["lines"] = [f"launch     {summary['launch']}"]
    elif args.to == "dtensor":
        import json

        from graphpar.export.dtensor_plan import plan_json

        plan = plan_json(compiled.spmd, compiled.graph, compiled.mesh, spec.name, args.mode,
                         len(spec.inputs))
        (staging / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
        (staging / "README.md").write_text(dtensor_readme(plan))
        sharded = sum(any(p.startswith("Shard") for p in e["placements"])
                      for e in plan["parameters"].values())
        planned = ", ".join(f"{k} {n}" for k, n in plan["collectives_planned"].items())
        summary["lines"] = [f"parameters {len(plan['parameters'])}, {sharded} sharded",
                            f"planned    {planned or 'no collectives'} per step (counted in "
                            "the device program)"]
    else:
        _write_mlir({compiled.graph.name: compiled.graph}, staging, summary)
    return summary


def _write_mlir(graphs: dict, staging: Path, summary: dict) -> None:
    from graphpar.export.mlir import mlir_module

    with step(f"importing {len(graphs)} graph(s) into torch-mlir"):
        (staging / "stages.mlir").write_text(mlir_module(graphs))
    summary["functions"] = list(graphs)
    summary["lines"] = [f"func.func  {', '.join('@' + n for n in graphs)} (torch dialect)"]


def dtensor_readme(plan: dict) -> str:
    shape = tuple(plan["mesh"]["shape"])
    return f"""# {plan['model']} ({plan['mode']}): a graphpar plan for DTensor

`plan.json` places every parameter of the module on a {'x'.join(map(str, shape))} device mesh
(`mesh.dim_names` {plan['mesh']['dim_names']}). Put it on your own module, in your own loop:

```python
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from graphpar.export import apply_plan

dist.init_process_group()   # under torchrun --nproc-per-node {math.prod(shape)}
mesh = init_device_mesh("cuda", {shape})
apply_plan(model, "plan.json", mesh)   # parameters become DTensors; inputs laid out as planned
loss = loss_fn(model(*inputs), *targets)   # outputs come back as full tensors
loss.backward()
```
"""


def _export_pipeline(args: argparse.Namespace, passes: list, staging: Path) -> dict:
    """Slice the training step into stages on sub-meshes of --mesh (as `compile --pipeline`),
    shard each stage on its sub-mesh as planned, and write the chosen format."""
    from graphpar.cli.pipeline import compile_pipeline

    # built with its weights: the program's constants (tensors a forward makes, lifted by
    # torch.export) are only real when the capture was
    compiled = compile_pipeline(args, passes, weights=True)
    with step("sharding the stages on their sub-meshes"):
        pipe = compiled.pipe.sharded_as_planned()
    world = sum(len(d) for d in pipe.devices)
    summary = {"model": compiled.spec.name, "mode": args.mode, "mesh": list(pipe.mesh.shape),
               "format": args.to, "stages": pipe.stages, "schedule": pipe.schedule_name,
               "microbatches": pipe.microbatches,
               "stage_ranks": [list(d) for d in pipe.devices]}
    if args.to == "mlir":  # each stage's graphs, whole: the torch dialect has no collectives
        from graphpar.export.torch_program import PHASE_NAMES, schedule_phases

        _write_mlir({f"stage{p.stage}_{PHASE_NAMES[phase]}": graph
                     for p in pipe.programs.stages for phase in schedule_phases(
                         pipe.schedule_name)
                     if (graph := p.program(phase)) is not None}, staging, summary)
        return summary
    if args.to == "dtensor":
        _write_pipeline_plan(pipe, compiled, staging, summary)
        return summary
    from graphpar.export.torch_program import write_pipeline_program

    with step("writing the torch program"):
        write_pipeline_program(pipe, pipe.captured.state, staging, compiled.spec.name)
    summary["launch"] = (f"torchrun --nproc-per-node {world} program.py --inputs IN.pt "
                         "--outputs OUT.pt")
    summary["lines"] = [f"stages     {pipe.stages} ({pipe.schedule_name}, {pipe.microbatches} "
                        f"microbatches), ranks {summary['stage_ranks']}",
                        f"launch     {summary['launch']}"]
    return summary


def _write_pipeline_plan(pipe, compiled, staging: Path, summary: dict) -> None:
    """plan.json with the pipeline section and torchtitan.toml."""
    import json

    from graphpar.export.dtensor_pipeline import pipeline_plan, torchtitan_toml
    from graphpar.export.dtensor_plan import FORMAT
    from graphpar.runtime.pipeline import stage_meshes

    pipeline = pipeline_plan(pipe, stage_meshes(pipe.stages, pipe.sharded),
                             len(compiled.spec.inputs[0]))
    parameters = {}
    for st in pipeline["stages"]:
        for name, placements in st["parameters"].items():
            parameters.setdefault(name, {"placements": placements})
    plan = {"format": FORMAT, "model": compiled.spec.name, "mode": "train",
            "mesh": {"dim_names": ["pp", "axis0"], "shape": list(pipe.mesh.shape)},
            "parameters": parameters, "buffers": {}, "inputs": [], "outputs": None,
            "pipeline": pipeline}
    (staging / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    (staging / "torchtitan.toml").write_text(torchtitan_toml(pipeline))
    summary["lines"] = [f"stage {s:<4} ranks {st['ranks']}, modules {', '.join(st['module_fqns'])}"
                        for s, st in enumerate(pipeline["stages"])]
    summary["lines"].append(f"schedule   {pipeline['schedule']}, {pipeline['microbatches']} "
                            "microbatches (torch.distributed.pipelining); torchtitan.toml")
