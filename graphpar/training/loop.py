"""`graphpar train`'s run: compile the step once, then train alone or as torchrun's ranks.

Alone, the driver compiles, writes the plan, the data and each rank's starting state to a job
folder (the one job protocol, `graphpar.runtime.jobs`) and sends its workers one `train`
command: each rank loops over the steps itself, holding its state (no process start and no
state sent per step), and rank 0 appends each step's record to the folder, which the driver
shows. Under torchrun, every process is one rank: rank 0 compiles and hands every rank the plan
and its starting shards over the process group, then all train. Either way, checkpoints are
DCP folders each rank writes its shards of (`graphpar.training.checkpoint`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphpar.capture.optim import optimizer_from_name
from graphpar.cost.limits import PlanLimits
from graphpar.errors import GraphparError, UsageError
from graphpar.ir.mesh import Mesh
from graphpar.runtime.overlap import DEFAULT_BUCKET_BYTES
from graphpar.training import checkpoint
from graphpar.training.plan import TrainPlan, initial_state, pipeline_plan_from, plan_from
from graphpar.training.report import Reporter

if TYPE_CHECKING:
    from graphpar.compiler.driver import ModelSpec

TIMEOUT_S = 300.0  # any one collective, and the workers' start


@dataclass
class TrainOptions:
    """`graphpar train`'s options, read once (the mesh and limits as objects)."""

    spec: ModelSpec
    mesh: Mesh
    limits: PlanLimits
    cluster: str
    steps: int
    optimizer: str = "adam"
    lr: float | None = None
    data: Path | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    log: Path | None = None
    seed: int = 0
    progress: bool = True
    # a pipelined plan: "auto" or a number of stages, its microbatches and schedule
    pipeline: str | None = None
    microbatches: int = 4
    schedule: str = "1f1b"
    token_slices: str | None = None  # "auto" or a number: the stages run token slices
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL), as `choose_device` resolved it
    # "auto": auto-shard's ILP chooses; or a hand plan's name (passes/autoshard/hand_plans.py)
    plan: str = "auto"


def under_torchrun() -> bool:
    """Whether torchrun (or another launcher setting its environment) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def local_ranks(mesh: Mesh) -> int:
    """How many ranks run on this machine: torchrun's LOCAL_WORLD_SIZE, else the mesh's
    devices (alone, every rank is a process here)."""
    if under_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return mesh.size


def choose_device(requested: str, *, cuda: bool, gpus: int, ranks: int,
                  pipelined: bool) -> str:
    """`--device auto|cpu|cuda` given what this machine has (`cuda`: torch.cuda.is_available(),
    `gpus` visible, `ranks` on this machine): "cpu" or "cuda". auto takes CUDA only when every
    local rank gets a GPU of its own; an explicit cuda that cannot be met is a usage error."""
    if requested == "cpu" or (requested == "auto" and (pipelined or not cuda or gpus < ranks)):
        return "cpu"
    if requested != "auto" and requested != "cuda":
        raise UsageError(f"--device {requested}: give auto, cpu or cuda")
    if not cuda:
        raise UsageError("--device cuda: this torch sees no CUDA GPU (torch.cuda.is_available() "
                         "is False); use --device cpu or auto")
    if gpus < ranks:
        raise UsageError(f"--device cuda: {ranks} ranks on this machine but {gpus} GPUs visible; "
                         "one GPU per rank (a smaller --mesh, or more CUDA_VISIBLE_DEVICES)")
    if pipelined:
        raise UsageError("--device cuda: pipelined plans train on CPU only for now; drop "
                         "--pipeline or use --device cpu")
    return "cuda"


def data_entry(options: TrainOptions) -> dict:
    """Where the batches come from: --data, else the model file's batch(step)."""
    spec = options.spec
    if options.data is not None:
        from graphpar.training.data import open_tokens

        open_tokens(options.data)  # a bad file is named now, before anything starts
        ok = (len(spec.inputs) == 1 and len(spec.targets) == 1 and spec.inputs[0].ndim == 2
              and not spec.inputs[0].is_floating_point()
              and spec.targets[0].shape == spec.inputs[0].shape)
        if not ok:
            raise UsageError(f"--data feeds a causal LM: a model taking token ids [batch, seq] "
                             f"with next-token targets [batch, seq]; {spec.name} takes "
                             f"{_shapes(spec.inputs)} with targets {_shapes(spec.targets)}: "
                             "define batch(step) in its model file instead")
        return {"kind": "tokens", "path": str(options.data.resolve()), "seed": options.seed}
    source = spec.source if spec.source.endswith(".py") else ""
    if source:
        from graphpar.compiler.model_file import model_function

        if model_function(source, "batch") is not None:
            return {"kind": "batch", "path": str(Path(source).resolve()),
                    "num_inputs": len(spec.inputs), "seed": options.seed}
    raise UsageError(f"{spec.name}: no data: give --data FILE (a token or text file) or define "
                     "batch(step) -> (inputs, targets) in the model file")


def _shapes(tensors) -> str:
    return ", ".join(f"{list(t.shape)}" for t in tensors) or "nothing"


@dataclass
class Start:
    """What every rank starts from: the plan, its shards, the data and the step."""

    plan: TrainPlan
    states: list[dict[str, torch.Tensor]]  # each rank's shards (an SPMD plan)
    data: dict
    step: int = 0
    resume: str | None = None
    pipe: Any = None  # a pipelined plan: a PipelineCompiled or a TokenPipeline (compiler)


def prepare(options: TrainOptions) -> Start:
    """Compile the step and find the checkpoint to resume from, checking it fits the model."""
    if options.spec.loss_fn is None:
        raise UsageError(f"{options.spec.name}: training needs a loss: define loss(output, "
                         "*targets) and targets() in the model file")
    data = data_entry(options)
    resume = checkpoint.resume_point(options.checkpoint_dir) if options.resume else None
    if resume is not None and resume[0] >= options.steps:
        raise UsageError(f"--resume: {resume[1]} is already at step {resume[0]}; give --steps "
                         f"above {resume[0]} to train on")
    optimizer = optimizer_from_name(options.optimizer, options.lr)
    if options.pipeline is not None:
        from graphpar.compiler.api import compile_pipelined_training

        pipe = compile_pipelined_training(options.spec, options.mesh, options.limits,
                                          optimizer, options.pipeline, options.microbatches,
                                          options.schedule,
                                          token_slices=options.token_slices)
        plan = pipeline_plan_from(pipe, options.spec, options.mesh, options.spec.name,
                                  options.cluster)
        start = Start(plan, [], data, pipe=pipe)
    else:
        compiled = _compile(options, optimizer)
        plan = plan_from(compiled, options.spec.name, options.cluster, options.plan)
        start = Start(plan, initial_state(compiled, plan), data)
    from graphpar.training.rank import batch_source

    batch_source(data, plan)(resume[0] if resume else 0)  # a bad batch() is named now
    if resume is not None:
        checkpoint.check_resumable(resume[1], plan)
        start.step, start.resume = resume[0], str(resume[1])
    return start


def _compile(options: TrainOptions, optimizer):
    """The step under `options.plan`; a hand plan that does not exist for this model or mesh
    is an error naming it."""
    from graphpar.compiler.api import compile_training
    from graphpar.passes.autoshard.hand_plans import NotApplicable

    try:
        return compile_training(options.spec, options.mesh, options.limits, optimizer,
                                bucket_bytes=DEFAULT_BUCKET_BYTES,  # as TrainRank runs
                                plan=options.plan)
    except NotApplicable as exc:
        raise NotApplicable(f"--plan {options.plan} for {options.spec.name} on mesh "
                            f"{options.mesh}: {exc}; choose another --plan (auto always "
                            "applies)") from None


def train(options: TrainOptions) -> dict:
    """Run `options`: alone, or as this process's rank under torchrun. Returns the summary
    (rank 0's; other ranks return an empty one)."""
    if under_torchrun():
        return train_as_torchrun_rank(options)
    start = prepare(options)
    reporter = Reporter(start.plan, options, first_step=start.step)
    run_alone(start, options, reporter)
    return reporter.finish()


def run_alone(start: Start, options: TrainOptions, reporter: Reporter) -> None:
    """One worker process per device (the one job protocol), one `train` command."""
    from graphpar.runtime.jobs import Job
    from graphpar.training.rank import PROGRESS, plan_description

    plan = start.plan
    worker = ("graphpar.training.rank:TrainWorker" if start.pipe is None
              else "graphpar.training.stage_rank:TokenTrainWorker" if _is_tokens(start.pipe)
              else "graphpar.training.stage_rank:StageTrainWorker")
    job = Job(plan.world, worker, prefix="train", timeout=TIMEOUT_S, name="training")
    finished = False
    try:
        if start.pipe is not None:
            write_pipeline_job(job.folder, start)
        else:
            job.folder.describe({"plan": plan_description(plan), "data": start.data,
                                 "timeout": TIMEOUT_S, "device": options.device})
            job.folder.write_text("step.gpir", plan.program)
            job.folder.save("constants.pt", plan.constants)
            job.save_each("state", start.states)
        job.start()
        command = job.send("train", start.step, options.steps, start.resume,
                           str(options.checkpoint_dir) if options.checkpoint_dir else None,
                           options.checkpoint_every)
        tail = _Tail(job.path / PROGRESS, reporter)
        job.group.wait(command, timeout=float("inf"), poll=tail.read)
        tail.read()
        finished = True
    finally:
        job.close(kill=not finished)


def write_pipeline_job(folder, start: Start) -> None:
    """A pipelined run's job folder: the pipeline runtime's (`runtime.pipeline.describe_job`:
    each stage's programs, starting state and action list) with the run's plan and data."""
    from graphpar.runtime.pipeline import describe_job
    from graphpar.runtime.token_pipeline import describe_token_job
    from graphpar.training.rank import plan_description
    from graphpar.training.stage_rank import loss_stage, stage_graphs, state_transfers

    pipe, plan = start.pipe, start.plan
    graphs = stage_graphs(pipe)
    train = {"plan": plan_description(plan), "data": start.data,
             "loss_rank": plan.pipeline["devices"][loss_stage(graphs)][0],
             "state_transfers": state_transfers(graphs)}
    if _is_tokens(pipe):
        describe_token_job(folder, pipe.programs, pipe.schedule, pipe.pipe.captured.state, [],
                           pipe.sharded, microbatches=pipe.pipe.microbatches,
                           timeout=TIMEOUT_S, train=train)
    else:
        describe_job(folder, pipe.programs, pipe.schedule, pipe.captured.state, [],
                     pipe.sharded, microbatches=pipe.microbatches, timeout=TIMEOUT_S,
                     train=train)
    folder.save("constants.pt", plan.constants)


def _is_tokens(pipe) -> bool:
    """Whether a pipelined plan runs token slices (a compiler.token_pipelined.TokenPipeline)."""
    return hasattr(pipe, "token_slices")


def train_as_torchrun_rank(options: TrainOptions) -> dict:
    """This process is rank $RANK of $WORLD_SIZE: rank 0 compiles and hands out the plan."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if options.pipeline is None and world != options.mesh.size:  # a pipeline: once compiled
        raise UsageError(f"torchrun started {world} processes (WORLD_SIZE) but --mesh "
                         f"{'x'.join(map(str, options.mesh.shape))} has {options.mesh.size} "
                         "devices: start one process per device (--nnodes x --nproc-per-node)")
    device = "cpu"
    if options.device == "cuda":
        # this rank's GPU before the group, so that NCCL and the object collectives use it;
        # gloo keeps the CPU side (the plan's broadcast, DCP's planning, the barriers)
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("cpu:gloo,cuda:nccl" if options.device == "cuda" else "gloo",
                            timeout=timedelta(seconds=TIMEOUT_S))
    cleanup: list[Path] = []
    try:
        outcome: list = [None]
        if rank == 0:
            try:
                start = prepare(options)
                if start.plan.world != world:
                    raise UsageError(
                        f"torchrun started {world} processes (WORLD_SIZE) but the pipelined "
                        f"plan runs on {start.plan.world} devices: start one process per "
                        "device")
                outcome = [(start.plan, start.data, start.step, start.resume,
                            _job_files(start) if start.pipe is not None else None)]
                states: list = start.states or [None] * world
            except Exception as exc:  # every rank hears why, none waits for a plan
                outcome = [exc if isinstance(exc, GraphparError)
                           else GraphparError(f"{type(exc).__name__}: {exc}")]
                states = [None] * world
                dist.broadcast_object_list(outcome, src=0)
                raise
        dist.broadcast_object_list(outcome, src=0)
        if isinstance(outcome[0], GraphparError):
            raise type(outcome[0])(f"rank 0: {outcome[0]}")
        plan, data, step, resume, files = outcome[0]
        if files is not None:  # a pipeline: this rank's worker reads the job folder rank 0 made
            import tempfile

            from graphpar.training.stage_rank import StageTrainWorker, TokenTrainWorker

            jobdir = Path(tempfile.mkdtemp(prefix="graphpar-train-"))
            cleanup.append(jobdir)
            for name, content in files.items():
                (jobdir / name).write_bytes(content)
            worker = TokenTrainWorker if plan.pipeline["token_slices"] else StageTrainWorker
            trainer = worker(jobdir, rank, world)
        else:
            mine: list = [None]
            dist.scatter_object_list(mine, states if rank == 0 else None, src=0)
            from graphpar.training.rank import TrainRank

            trainer = TrainRank(plan, rank, data, mine[0], device=device)
        if resume:
            trainer.load(Path(resume))
        reporter = Reporter(plan, options, first_step=step) if rank == 0 else None
        trainer.run_steps(step, options.steps,
                      str(options.checkpoint_dir) if options.checkpoint_dir else None,
                      options.checkpoint_every, reporter.record if reporter else None)
        dist.barrier()
        return reporter.finish() if reporter else {}
    finally:
        dist.destroy_process_group()
        for folder in cleanup:
            shutil.rmtree(folder, ignore_errors=True)


def _job_files(start: Start) -> dict[str, bytes]:
    """A pipelined run's job folder as {file: content}, for torchrun's ranks (on other
    machines too): rank 0 writes it locally, every rank rebuilds it in its own folder."""
    import tempfile

    from graphpar.runtime.jobs import JobFolder

    folder = Path(tempfile.mkdtemp(prefix="graphpar-train-"))
    try:
        write_pipeline_job(JobFolder(folder), start)
        return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Tail:
    """Rank 0's per-step records as the driver reads them from the job folder, line by line."""

    def __init__(self, path: Path, reporter: Reporter) -> None:
        self.path, self.reporter = path, reporter
        self.offset, self.pending = 0, ""

    def read(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as file:
                file.seek(self.offset)
                text = file.read()
                self.offset = file.tell()
        except FileNotFoundError:
            return
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.strip():
                self.reporter.record(json.loads(line))
