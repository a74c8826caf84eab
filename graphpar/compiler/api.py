"""The Python API: `graphpar.compile(module, inputs, mesh=..., mode=...)` and what it returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graphpar.capture import Captured
from graphpar.capture.optim import Optimizer
from graphpar.cost.cluster import mesh_for
from graphpar.cost.limits import DEFAULT_MEMORY, DEFAULT_TIME_SECONDS, PlanLimits
from graphpar.errors import UsageError
from graphpar.ir.cuda_listing import Listing
from graphpar.ir.graph import Graph, OutputRole
from graphpar.ir.mesh import Mesh
from graphpar.passes import PassContext, PassManager, parse_pipeline
from graphpar.passes.autoshard.auto_shard import AutoShard, ShardingPlans
from graphpar.passes.autoshard.ilp import Plan
from graphpar.passes.lower_spmd import graph_mesh

if TYPE_CHECKING:
    from graphpar.compiler.check.eager import EagerCheck
    from graphpar.compiler.driver import ModelSpec
    from graphpar.compiler.pipelined import PipelineCompiled
    from graphpar.compiler.token_pipelined import TokenPipeline
    from graphpar.runtime.program import StepTimes


@dataclass
class Compiled:
    """A model compiled for a mesh: the sharded global graph, its plan and its device program.

    `run(*inputs)` executes the device program on CPU ranks (all in this process, or one
    process per rank over gloo) and returns global outputs, like calling the module.
    `check()` runs it on the example it was compiled from and compares every output with
    eager PyTorch (and torch.optim, for a training step).
    """

    captured: Captured  # the sharded global graph and the state tensors it starts from
    spmd: Graph  # the program every device runs
    plan: Plan
    mesh: Mesh
    # per rank, last run: bytes sent by the plan's definition (the cost model's formula per
    # collective, so equal to `predicted_bytes` by construction), and the payloads handed to
    # gloo (None when the ranks ran in this process: no wire)
    bytes_sent: list[float] = field(default_factory=list)
    bytes_counted: list[float] | None = None
    spec: ModelSpec | None = None  # the module and example it was compiled from
    optimizer: Optimizer | None = None  # a training step's, as torch.optim runs it
    # the CUDA backend's: each rank's listing (made on first use) and, after a run on the
    # CPU, the arena bytes each rank wrote up to (measured)
    listings: list[Listing] | None = None
    peak_arena_bytes: list[int] = field(default_factory=list)

    @property
    def graph(self) -> Graph:
        return self.captured.graph

    @property
    def predicted_bytes(self) -> float:
        """Bytes each device sends per step, as the plan's cost model predicts them."""
        return float(self.spmd.attrs.get("predicted_bytes_per_device", 0.0))

    def rank_inputs(self, *args: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        from graphpar.runtime.spmd import shard_tensor

        named = self.captured.bind(*args)
        return [{v.name: shard_tensor(named[v.name], v.layout, self.mesh, device)
                 for v in self.spmd.inputs} for device in range(self.mesh.size)]

    def cuda_listings(self) -> list[Listing]:
        """Each rank's CUDA listing of the device program (`lower-cuda`)."""
        if self.listings is None:
            from graphpar.passes.lower_cuda import lower_to_listing

            self.listings = [lower_to_listing(self.spmd, self.mesh, rank)
                             for rank in range(self.mesh.size)]
        return self.listings

    def run(self, *args: torch.Tensor, processes: bool = False, backend: str = "interpreter",
            poison: bool = False) -> list[torch.Tensor]:
        """`backend="cuda"` runs each rank's CUDA listing call for call on the CPU (one
        process per rank over gloo when they communicate; `poison`: freed buffers become NaN
        bytes) instead of the IR interpreter."""
        return self.run_steps(args, 1, processes=processes, backend=backend, poison=poison)[0]

    def run_steps(self, args: Sequence[torch.Tensor], steps: int, processes: bool = False,
                  backend: str = "interpreter", poison: bool = False
                  ) -> list[list[torch.Tensor]]:
        """`steps` steps on the same `args`, each from the state the last one left (a
        training step's updated parameters and optimizer state), the state compiled from the
        module restored afterwards; every step's global outputs. With `processes` the steps
        run on one set of gloo worker processes."""
        from graphpar.runtime.spmd import run_spmd_in_process, unshard

        if backend not in ("interpreter", "cuda"):
            raise UsageError(f"unknown backend {backend!r}: use 'interpreter' or 'cuda'")
        saved = dict(self.captured.state)
        job = None
        if processes and backend == "interpreter":
            from graphpar.runtime.launch import SpmdJob

            job = SpmdJob(self.spmd, self.mesh)
        results = []
        try:
            for _ in range(steps):
                per_rank = self.rank_inputs(*args)
                if backend == "cuda":
                    from graphpar.runtime.cuda_listing import run_listings

                    result = run_listings(self.cuda_listings(), per_rank, self.mesh,
                                          poison=poison)
                    outputs = result.outputs
                    self.peak_arena_bytes = result.peak_arena_bytes
                elif job is not None:
                    outputs = job.run(per_rank)
                else:
                    outputs = run_spmd_in_process(self.spmd, per_rank, self.mesh)
                self.bytes_sent = list(outputs.bytes_sent)
                self.bytes_counted = outputs.bytes_counted
                step = [unshard([rank[i] for rank in outputs], out.value.layout, self.mesh)
                        for i, out in enumerate(self.spmd.outputs)]
                results.append(step)
                self.captured.apply_updates(step)
        finally:
            self.captured.state = saved
            if job is not None:
                job.close()
        return results

    def step(self, *args: torch.Tensor, processes: bool = False) -> list[torch.Tensor]:
        """One training step: run, then keep the updated parameters and optimizer state."""
        outputs = self.run(*args, processes=processes)
        self.captured.apply_updates(outputs)
        return outputs

    def check(self, processes: bool = False, backend: str = "interpreter",
              poison: bool = False, steps: int = 1, localize: bool = True) -> EagerCheck:
        """Run `steps` steps on the example inputs (and targets) it was compiled from, state
        carried, and compare each output of each step with eager PyTorch in float64 and its
        float32 rounding (`graphpar.compiler.check.eager`): for a training step the loss, every
        gradient (when the step returns them: compile with keep_grads=True), every updated
        parameter and optimizer state against `steps` real torch.optim steps. The module and
        the compiled state are not changed. When the check fails and `localize`, it also finds
        the first node of the plan that differs (`EagerCheck.where`)."""
        from graphpar.compiler.check.eager import compare, eager_reference

        train = any(o.role is OutputRole.LOSS for o in self.spmd.outputs)
        steps = steps if train else 1
        reference = eager_reference(self.spec_or_raise(), train, self.optimizer, steps)
        outputs = self.run_steps(self.example_args(), steps, processes=processes,
                                 backend=backend, poison=poison)
        check = compare(self.spmd.outputs, outputs, reference)
        if localize and not check.within_tolerance:
            from graphpar.compiler.check.localize import first_difference, state_before

            before = outputs[:check.worst.step - 1]  # the failing step's, from the plan's state
            check.where = first_difference(
                self.captured, self.example_args(),
                state_before(self.spmd, self.captured.state, before))
        return check

    def spec_or_raise(self) -> ModelSpec:
        if self.spec is None:
            raise UsageError("this plan does not know the module it came from: compile it "
                             "with graphpar.compile, or give lower() its spec")
        return self.spec

    def time_steps(self, steps: int = 5, warmup: int = 2, repeats: int = 1,
                   args: Sequence[torch.Tensor] | None = None, profile: bool = False
                   ) -> list[StepTimes]:
        """Measure the step on one process per rank over gloo, on `args` (by default the
        example it was compiled from): `repeats` times (one set of worker processes for all),
        `warmup` untimed steps then `steps` timed ones each. Collectives use gloo's own
        all-reduce (what a real run uses), not the bit-reproducible gather-and-sum of `run`.
        `profile`: the last repeat also times every node of the device program."""
        from graphpar.runtime.launch import SpmdJob

        per_rank = self.rank_inputs(*(self.example_args() if args is None else args))
        with SpmdJob(self.spmd, self.mesh, deterministic=False) as job:
            return [job.time_steps(per_rank, steps, warmup, profile=profile and r == repeats - 1)
                    for r in range(repeats)]

    def example_args(self) -> tuple[torch.Tensor, ...]:
        """The inputs it was compiled from, and for a training step the targets."""
        spec = self.spec_or_raise()
        train = any(o.role is OutputRole.LOSS for o in self.spmd.outputs)
        return spec.inputs + (spec.targets if train else ())

    def loss_index(self) -> int:
        return next(i for i, o in enumerate(self.spmd.outputs) if o.role is OutputRole.LOSS)


def compile(module: torch.nn.Module, inputs: Sequence[torch.Tensor], mesh: str | Mesh = "1x4",
            mode: str = "infer", loss_fn: Callable | None = None,
            targets: Sequence[torch.Tensor] = (), optimizer: Optimizer | None = None,
            cluster: str = "dgx-a100", memory_limit: str = DEFAULT_MEMORY,
            time_limit: float = DEFAULT_TIME_SECONDS,
            passes: str = "cleanup", keep_grads: bool = False,
            pipeline: str | int | None = None, microbatches: int = 4,
            schedule: str = "1f1b",
            token_slices: str | int | None = None) -> Compiled | PipelineCompiled:
    """Capture `module`, auto-shard it on `mesh` and lower it to its SPMD device program.
    `keep_grads`: a training step also returns its gradients (for `Compiled.check`).
    `memory_limit` per device: "device" (the cluster's memory per device), "none" or a size
    like "40GB"; `time_limit`: seconds for each ILP. Both bound every ILP the compile solves,
    the stages' re-solves on their sub-meshes included.

    With `pipeline` ("auto" or a number of stages; training only) the step is instead sliced
    into pipeline stages on sub-meshes of `mesh` (Alpa's inter-op pass over the ILP) and run
    by `schedule` ("gpipe", "1f1b", "zb") over `microbatches`: a `PipelineCompiled`, whose
    `.plan` is the stage plan and whose `check()` runs one step against eager. With
    `token_slices` ("auto" or a number of slices; a causal LM, with `pipeline` only) each
    sequence is also cut into token slices (TeraPipe), recorded in the step graph's attrs
    `token_slices` and `batch_slices`."""
    from graphpar.compiler.driver import ModelSpec, compile_model

    spec = ModelSpec(type(module).__name__, module, tuple(inputs), loss_fn, tuple(targets))
    if token_slices is not None and pipeline is None:
        raise UsageError("token_slices= sends token slices through pipeline stages: pass "
                         "pipeline= too")
    if pipeline is not None and mode != "train":
        raise UsageError("pipeline= slices a training step into stages: pass mode='train'")
    mesh = mesh_for(mesh, cluster)  # the user's options, read once
    limits = PlanLimits.parse(memory_limit, time_limit, mesh.cluster)
    if pipeline is not None:
        from graphpar.compiler.pipelined import slice_and_build
        from graphpar.passes.pipeline.slice_tokens import slice_count

        sliced = slice_and_build(spec, mesh, limits, stages=pipeline,
                                 microbatches=microbatches, schedule=schedule,
                                 optimizer=optimizer, passes=parse_pipeline(passes),
                                 keep_grads=keep_grads, token_slices=slice_count(token_slices))
        return sliced.pipe.sharded_as_planned()
    passes = [*parse_pipeline(passes), AutoShard.of(mesh, limits)]
    result = compile_model(spec, mode, passes, optimizer=optimizer, keep_grads=keep_grads)
    return lower(result.captured, result.context, spec=spec, optimizer=optimizer)


def compile_training(spec: ModelSpec, mesh: Mesh, limits: PlanLimits, optimizer: Optimizer,
                     passes: str = "cleanup", bucket_bytes: int | None = None,
                     plan: str = "auto") -> Compiled:
    """A model file's (or example's) training step auto-sharded on `mesh` under `limits`, both
    read once where the user's options were (`graphpar train`), lowered to its device
    program. `bucket_bytes`: the ranks will all-reduce gradients in buckets of about that
    many bytes, and the plan is chosen knowing it. `plan`: "auto" (the ILP's cheapest plan)
    or a hand plan's name (`passes/autoshard/hand_plans.py`: the cheapest plan its rules
    allow); a hand plan that does not exist for the model or mesh raises NotApplicable."""
    from graphpar.compiler.driver import compile_model

    pipeline = [*parse_pipeline(passes),
                AutoShard.of(mesh, limits, bucket_bytes=bucket_bytes, plan=plan)]
    result = compile_model(spec, "train", pipeline, optimizer=optimizer)
    return lower(result.captured, result.context, spec=spec, optimizer=optimizer)


def compile_pipelined_training(spec: ModelSpec, mesh: Mesh, limits: PlanLimits,
                               optimizer: Optimizer, stages: str | int = "auto",
                               microbatches: int = 4, schedule: str = "1f1b",
                               passes: str = "cleanup", token_slices: str | int | None = None
                               ) -> PipelineCompiled | TokenPipeline:
    """A model file's training step sliced into pipeline stages on sub-meshes of `mesh`
    (`stages`: "auto" or a number) over `microbatches`, run by `schedule`, each stage on
    several devices auto-sharded there under `limits` (`graphpar train --pipeline`). With
    `token_slices` ("auto": slice-tokens' DP, or a number of equal slices) the stages run
    token slice by token slice: a `TokenPipeline`."""
    from graphpar.compiler.pipelined import slice_and_build
    from graphpar.passes.pipeline.slice_tokens import slice_count

    sliced = slice_and_build(spec, mesh, limits, stages=stages, microbatches=microbatches,
                             schedule=schedule, optimizer=optimizer,
                             passes=parse_pipeline(passes),
                             # token slicing feeds the update programs the gradients by name
                             keep_grads=token_slices is not None,
                             token_slices=slice_count(token_slices, "--token-slices "))
    if token_slices is None:
        return sliced.pipe.sharded_as_planned()
    from graphpar.compiler.token_pipelined import token_pipeline

    tokens = token_pipeline(sliced.pipe, list(sliced.result.graph.attrs["token_slices"]),
                            schedule)
    submeshes = sliced.pipe.planned_submeshes()
    return tokens.on_submeshes(submeshes) if submeshes else tokens


def lower(captured: Captured, ctx: PassContext, spec: ModelSpec | None = None,
          optimizer: Optimizer | None = None) -> Compiled:
    """The device program of an auto-sharded capture (its graph stays the global one);
    `spec` and `optimizer`, what it was captured from, let `Compiled.check` compare it."""
    plan = ctx.result(ShardingPlans)[captured.graph.name]
    program = PassManager(parse_pipeline("lower-spmd")).run(captured.graph.copy(), ctx)
    return Compiled(captured, next(iter(program)), plan, graph_mesh(captured.graph),
                    spec=spec, optimizer=optimizer)
