"""The pipeline runtime: each stage runs its schedule's action list over its stage programs.

A stage's programs (forward F, backward B or its parts I and W, update U: a
`graphpar.ir.pipeline_programs.StageProgram`, built by `graphpar.passes.pipeline.stage_programs`)
exchange tensors by name. A :class:`StageRunner` holds one stage's state: its parameters and
optimizer state, per microbatch the named tensors it received or kept from its forward for its
backward, the gradients it accumulates, the losses. It runs one action at a time; what moves
between stages is what `outgoing` returns and `incoming` takes, so the same runner serves

- `run_in_process`: every stage in this process, actions interleaved in a valid order, the
  transfers through mailboxes (the reference execution of a schedule), and
- `run_multiprocess`: one process per device over gloo, a job of `runtime.jobs` (its worker is
  :class:`PipelineWorker`): a stage's devices run its sharded phases over process groups of its
  sub-mesh, tensors cross between sub-meshes as tiles (`graphpar.ir.cross_mesh`), a boundary's
  tiles as one message per pair of ranks whose receive is posted ahead, each rank times its own
  actions.

After the last microbatch, the batch gradient is the mean of the microbatch gradients (the
loss is a mean over the batch), and U applies it once. The reported loss is the mean of the
microbatch losses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphpar.backends.interpreter import Interpreter
from graphpar.cost.timeline import Span
from graphpar.errors import BackendError, GraphparError, ScheduleError
from graphpar.ir.cross_mesh import TileTransfer, stage_devices, tile_transfer
from graphpar.ir.graph import Graph, OutputRole
from graphpar.ir.mesh import Mesh
from graphpar.ir.pipeline_programs import PHASES, PipelinePrograms, StageProgram
from graphpar.ir.schedule import COMPUTE_KINDS, Action, ActionKind, Schedule, validate
from graphpar.ir.types import TensorType
from graphpar.runtime.jobs import Job, JobWorker, mesh_entry

__all__ = ["PipelineRun", "PipelineWorker", "ReceivesAhead", "StageRunner", "assemble_outputs",
           "describe_job", "gather_whole", "run_in_process", "run_multiprocess",
           "split_microbatches", "stage_meshes"]

_PHASE = {ActionKind.F: "F", ActionKind.B: "B", ActionKind.I: "I", ActionKind.W: "W"}
# a boundary whose receives are posted: called, it waits for them and gives (names, tensors)
_Arrival = Callable[[], tuple[Sequence[str], list[torch.Tensor]]]


class MicrobatchError(GraphparError):
    """The batch cannot be cut into the asked number of microbatches."""


def split_microbatches(tensors: Mapping[str, torch.Tensor], microbatches: int
                       ) -> list[dict[str, torch.Tensor]]:
    """The user inputs cut along dimension 0 (the batch) into `microbatches` equal parts."""
    for name, t in tensors.items():  # checked before any part is made
        if t.dim() == 0 or t.shape[0] % microbatches:
            raise MicrobatchError(
                f"input {name!r} of shape {tuple(t.shape)} cannot be cut into {microbatches} "
                f"microbatches: its batch dimension (dimension 0) must be a multiple of "
                f"{microbatches}; choose a number of microbatches that divides the batch")
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(microbatches)]
    for name, t in tensors.items():
        for m, chunk in enumerate(t.chunk(microbatches, dim=0)):
            parts[m][name] = chunk.contiguous()
    return parts


class StageRunner:
    """One stage of a pipelined training step: runs its actions, keeps its tensors."""

    def __init__(self, program: StageProgram, microbatches: int,
                 state: Mapping[str, torch.Tensor],
                 inputs: Sequence[Mapping[str, torch.Tensor]],
                 sharded: Mapping[str, Any] | None = None, comm: Any = None) -> None:
        self.program = program
        # phase -> ShardedPhase (device_program, mesh): run on the stage's sub-mesh
        self.sharded = dict(sharded or {})
        # this process's device of the stage's sub-mesh (a GlooCommunicator): sharded phases
        # run their SPMD program for that device only; None: for every device in lockstep
        self.comm = comm
        self.device_interpreters: dict[str, Interpreter] = {}
        self.intra_stage_bytes = 0  # what the sub-mesh's collectives sent (plan's definition)
        self.stage = program.stage
        self.microbatches = microbatches
        self.interpreters = {p: Interpreter(g) for p in ("F", "B", "I", "W", "U")
                             if (g := program.program(p)) is not None}
        self.needed = frozenset(v.name for i in self.interpreters.values()
                                for v in i.graph.inputs)
        self.bytes_sent = 0
        # called with (stage, phase, microbatch or None for the update, inputs, results) after
        # each phase runs: what a check that looks inside the step reads
        self.observe: Callable[..., None] | None = None
        self.next_step(state, inputs)

    def next_step(self, state: Mapping[str, torch.Tensor],
                  inputs: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Start a step from `state` on `inputs` (per microbatch, the user's tensors by
        name), keeping the programs' interpreters: what a training run calls between steps."""
        self.inputs = inputs
        self.state = {k: v for k, v in state.items() if k in self.needed}
        self.env: list[dict[str, torch.Tensor]] = [{} for _ in range(self.microbatches)]
        self.grad_sums: dict[str, torch.Tensor] = {}
        self.grad_outputs: dict[str, torch.Tensor] = {}  # GRAD outputs, summed
        self.losses: dict[int, torch.Tensor] = {}
        self.updates: dict[str, torch.Tensor] = {}  # UPDATE outputs by target
        self.spans: list[tuple[Action, float, float]] = []  # measured: action, start, end
        self.backward_done: set[int] = set()  # microbatches whose gradients are summed
        self.sent_back: set[int] = set()  # microbatches whose SEND_B has run

    # --- compute ----------------------------------------------------------------------------

    def compute(self, action: Action) -> None:
        start = time.perf_counter()
        if action.kind is ActionKind.UPDATE:
            self.update()
        else:
            self._run(_PHASE[action.kind], action.microbatch)
        self.spans.append((action, start, time.perf_counter()))

    def _run(self, phase: str, m: int) -> None:
        interpreter = self.interpreters.get(phase)
        env = self.env[m]
        if interpreter is not None:
            graph = interpreter.graph
            args = {v.name: self._lookup(v.name, env, m) for v in graph.inputs}
            results = self._execute(phase, args)
            if self.observe is not None:
                self.observe(self.stage, phase, m, args, results)
            for out, t in zip(graph.outputs, results):
                self._keep(out.role, out.target, t, env, m)
        if phase == "F":  # keep what the backward (or a later send) reads
            keep = self.program.keep_after_forward | set(self.program.send_forward)
            for name in [n for n in env if n not in keep]:
                del env[name]
        elif phase in ("B", "W") or (phase == "I" and "W" not in self.interpreters):
            self._backward_done(m)

    def _execute(self, phase: str, args: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Run a phase program on whole tensors: directly, or as the SPMD program of the
        stage's sub-mesh, each device given its shard and the results gathered whole."""
        sharded = self.sharded.get(phase)
        if sharded is None:
            return self.interpreters[phase].run(args)
        if self.comm is not None:
            return self._execute_on_device(phase, sharded.device_program, args)
        from graphpar.runtime.spmd import run_spmd_in_process, shard_tensor, unshard

        program, mesh = sharded.device_program, sharded.mesh
        per_device = [{v.name: shard_tensor(args[v.name], v.layout, mesh, d)
                       for v in program.inputs} for d in range(mesh.size)]
        outputs = run_spmd_in_process(program, per_device, mesh)
        self.intra_stage_bytes += int(sum(outputs.bytes_sent))
        return [unshard([rank[i] for rank in outputs], out.value.layout, mesh)
                for i, out in enumerate(program.outputs)]

    def _execute_on_device(self, phase: str, program: Graph, args: dict[str, torch.Tensor]
                           ) -> list[torch.Tensor]:
        """This device's part of a sharded phase: its shards in, the phase's SPMD program over
        the sub-mesh's process groups, each output made whole again by an all-gather over the
        sub-mesh (the phase boundary)."""
        from graphpar.runtime.spmd import shard_tensor

        comm = self.comm
        interpreter = self.device_interpreters.get(phase)
        if interpreter is None:
            interpreter = self.device_interpreters[phase] = Interpreter(program, comm)
        device = comm.mesh.device_ids[comm.rank]
        local = {v.name: shard_tensor(args[v.name], v.layout, comm.mesh, device)
                 for v in program.inputs}
        before = comm.bytes_sent
        outputs = [gather_whole(comm, t, out.value.layout)
                   for t, out in zip(interpreter.run(local), program.outputs)]
        self.intra_stage_bytes += int(comm.bytes_sent - before)
        return outputs

    def _backward_done(self, m: int) -> None:
        if m in self.backward_done:
            return
        self.backward_done.add(m)
        for name in self.program.grads:
            t = self.env[m].get(name)
            if t is not None:
                self.grad_sums[name] = (t.clone() if name not in self.grad_sums
                                        else self.grad_sums[name] + t)
        env = self.env[m]  # only what is still to be sent back
        self.env[m] = ({} if m in self.sent_back else
                       {n: env[n] for n in self.program.send_backward if n in env})

    def _lookup(self, name: str, env: dict, m: int) -> torch.Tensor:
        for where in (env, self.inputs[m], self.state):
            if name in where:
                return where[name]
        raise GraphparError(f"pipeline stage {self.stage}: microbatch {m} has no tensor "
                            f"%{name} (a transfer the schedule did not make)")

    def _keep(self, role: OutputRole, target: str | None, t: torch.Tensor, env: dict,
              m: int) -> None:
        if role is OutputRole.OUTPUT:
            env[target] = t
        elif role is OutputRole.LOSS:
            self.losses[m] = t
        elif role is OutputRole.GRAD:
            self.grad_outputs[target] = (t.clone() if target not in self.grad_outputs
                                         else self.grad_outputs[target] + t)
        elif role is OutputRole.UPDATE:
            # a forward's update (batch-norm statistics) carries on to the next microbatch
            if target in self.state:
                self.state[target] = t
            self.updates[target] = t

    def update(self, received: Mapping[str, torch.Tensor] | None = None) -> None:
        """The optimizer step on the mean gradients: this stage's sums, and those `received`
        from the stages that summed them, divided by the number of microbatches."""
        interpreter = self.interpreters.get("U")
        if interpreter is None:
            return
        grads = {name: t / self.microbatches for name, t in self.grad_sums.items()}
        grads.update({name: t / self.microbatches for name, t in (received or {}).items()})
        graph = interpreter.graph
        args = {v.name: grads[v.name] if v.name in grads else self.state[v.name]
                for v in graph.inputs}
        results = self._execute("U", args)
        if self.observe is not None:
            self.observe(self.stage, "U", None, args, results)
        for out, t in zip(graph.outputs, results):
            if out.role is OutputRole.UPDATE:
                self.updates[out.target] = t

    # --- transfers --------------------------------------------------------------------------

    def outgoing(self, action: Action) -> list[torch.Tensor]:
        """The tensors a SEND action sends, in the order of the program's names."""
        names = (self.program.send_forward if action.kind is ActionKind.SEND_F
                 else self.program.send_backward)
        env = self.env[action.microbatch]
        tensors = [self._lookup(n, env, action.microbatch) for n in names]
        if action.kind is ActionKind.SEND_B:
            self.sent_back.add(action.microbatch)
        for n in names:  # sent: what the stage itself no longer reads is dropped
            if action.kind is ActionKind.SEND_B or n not in self.program.keep_after_forward:
                if action.kind is ActionKind.SEND_F or action.microbatch in self.backward_done:
                    env.pop(n, None)
        return tensors

    def incoming(self, action: Action, names: Sequence[str],
                 tensors: Sequence[torch.Tensor]) -> None:
        self.env[action.microbatch].update(zip(names, tensors))

    def mean_loss(self) -> torch.Tensor | None:
        return mean_loss(self.losses)


def gather_whole(comm: Any, local: torch.Tensor, layout: Any) -> torch.Tensor:
    """The whole tensor on every device of `comm`'s mesh, from each device's `local` part of
    it in `layout`: an all-gather over every mesh axis (group order is rank order), then
    `unshard`. A replicated tensor is whole already."""
    from graphpar.runtime.spmd import unshard

    if layout is None or layout.is_replicated:
        return local
    axes = tuple(range(comm.mesh.ndim))
    parts = comm.all_gather(local.unsqueeze(0), axes, 0).unbind(0)
    return unshard(list(parts), layout, comm.mesh)


def stage_meshes(stages: int, sharded: Mapping[int, Mapping[str, Any]] | None
                 ) -> list[Mesh]:
    """Each stage's sub-mesh, its devices global ranks laid out stage after stage: a stage in
    `sharded` has the shape its phases were planned on, any other one device."""
    shapes = []
    for s in range(stages):
        planned = next(iter(((sharded or {}).get(s) or {}).values()), None)
        shapes.append(tuple(planned.mesh.shape) if planned is not None else (1,))
    devices = stage_devices(stages, [math.prod(shape) for shape in shapes])
    return [Mesh(shape, d) for shape, d in zip(shapes, devices)]


def mean_loss(losses: Mapping[int, torch.Tensor]) -> torch.Tensor | None:
    """The step's loss: the mean of its microbatches' losses (None for a stage without the
    loss)."""
    if not losses:
        return None
    return torch.stack([losses[m] for m in sorted(losses)]).mean()


@dataclass
class PipelineRun:
    """One pipelined step: the training graph's outputs and what the run measured and
    counted. Bytes are counted by the plan's definition (each tile, each collective as the
    cost model defines it) unless named counted at gloo."""

    outputs: list[torch.Tensor]  # in the order of the training graph's outputs
    bytes_sent: list[int]  # per stage, activations and gradients across meshes
    spans: list[Span] = field(default_factory=list)  # measured, seconds from the step's start
    # per stage, inside its sub-mesh: its phases' collectives and the all-gathers that make a
    # phase's outputs whole (the in-process lockstep counts the collectives only)
    intra_stage_bytes: list[int] = field(default_factory=list)
    # per stage: the local all-gathers that join the tiles it received (Alpa's local
    # all-gather; on gloo ranks only)
    gathered_bytes: list[int] = field(default_factory=list)
    # microbatch tensors still held when the step ended (stash, received): 0 unless leaked
    tensors_left: int = 0
    # repeated steps timed after it (run_multiprocess's timed_steps), measured: wall seconds
    # per step and stage, and per stage its forward and backward seconds in each step
    step_times: Any = None  # graphpar.runtime.program.StepTimes
    stage_compute_seconds: list[list[float]] = field(default_factory=list)
    # per stage, what crossed to other stages as gloo payloads: the packed messages handed
    # to torch.distributed, padding included (None when the stages ran in this process)
    bytes_counted: list[int] | None = None


def assemble_outputs(graph: Graph, runners: Sequence[Any], microbatches: int
                     ) -> list[torch.Tensor]:
    """The training graph's outputs from its stages' results: the mean loss, the mean
    gradient, the updated parameters, state and buffers. `runners` are StageRunners or
    anything with the same `losses`/`grad_outputs`/`updates`/`mean_loss`."""
    losses = [r.mean_loss() for r in runners if r.losses]
    grads: dict[str, torch.Tensor] = {}
    updates: dict[str, torch.Tensor] = {}
    for r in runners:
        for name, t in r.grad_outputs.items():
            grads[name] = grads[name] + t if name in grads else t
        updates.update(r.updates)
    outputs = []
    for out in graph.outputs:
        if out.role is OutputRole.LOSS:
            outputs.append(losses[0])
        elif out.role is OutputRole.GRAD:
            outputs.append(grads[out.target] / microbatches)
        elif out.role is OutputRole.UPDATE:
            outputs.append(updates[out.target])
        else:
            raise GraphparError("a pipelined step returns a loss, gradients and updates; the "
                                f"graph has a {out.role.value} output")
    return outputs


def run_in_process(programs: PipelinePrograms, schedule: Schedule,
                   state: Mapping[str, torch.Tensor],
                   inputs: Sequence[Mapping[str, torch.Tensor]],
                   sharded: Mapping[int, Mapping[str, Any]] | None = None,
                   observe: Callable[..., None] | None = None) -> PipelineRun:
    """One step with every stage in this process: the stages take turns, each running actions
    until it waits for a transfer that has not been sent; a send lands in a mailbox.

    `inputs`: per microbatch, the user's tensors by name (`split_microbatches`). `sharded`:
    stage -> phase -> `lower_mpmd.ShardedPhase` for stages on more than one device, whose
    phases run as SPMD programs on their sub-mesh (lockstep, in this process). `observe`:
    called after every phase (`StageRunner.observe`)."""
    validate(schedule)
    stages = programs.stages
    if len(schedule) != len(stages):
        raise ScheduleError(f"the schedule has {len(schedule)} stages, the programs "
                            f"{len(stages)}")
    microbatches = len(inputs)
    runners = [StageRunner(p, microbatches, state, inputs, (sharded or {}).get(p.stage))
               for p in stages]
    for runner in runners:
        runner.observe = observe
    meshes = stage_meshes(len(stages), sharded)
    mailbox: dict[tuple[ActionKind, int, int], list[torch.Tensor]] = {}
    start = take_turns(schedule, lambda s, action: _step(action, runners, mailbox, programs,
                                                        meshes), "pipeline")
    spans = [Span(r.stage, a, t0 - start, t1 - start, rank=r.stage)
             for r in runners for a, t0, t1 in r.spans]
    return PipelineRun(assemble_outputs(programs.graph, runners, microbatches),
                       [r.bytes_sent for r in runners], spans,
                       [r.intra_stage_bytes for r in runners],
                       sum(len(env) for r in runners for env in r.env))


def take_turns(schedule: Schedule, step: Callable[[int, Action], bool], what: str) -> float:
    """Run every stage's action list in this process, the stages taking turns: each runs
    actions while `step(stage, action)` can (False: it waits for a transfer not yet made), then
    the next stage; a ScheduleError names the actions waiting if no stage can move. Returns
    when it started (`time.perf_counter`), the origin of the spans."""
    position = dict.fromkeys(schedule, 0)
    start = time.perf_counter()
    while any(position[s] < len(schedule[s]) for s in schedule):
        moved = False
        for s, actions in schedule.items():
            while position[s] < len(actions) and step(s, actions[position[s]]):
                position[s] += 1
                moved = True
        if not moved:
            stuck = [str(schedule[s][position[s]]) for s in schedule
                     if position[s] < len(schedule[s])]
            raise ScheduleError(f"the {what} is stuck waiting at {', '.join(stuck)}")
    return start


def _bytes_across(t: torch.Tensor, src: Mesh, dst: Mesh) -> int:
    """What moving `t` from sub-mesh `src` to `dst` sends across, as its tiles."""
    return tile_transfer(TensorType.of(t), src.device_ids, dst.device_ids).bytes_across


def _step(action: Action, runners: list[StageRunner], mailbox: dict,
          programs: PipelinePrograms, meshes: Sequence[Mesh]) -> bool:
    """Run `action` if it can run now; False if it waits for a transfer."""
    s, kind, m = action.stage, action.kind, action.microbatch
    runner = runners[s]
    if kind in (ActionKind.SEND_F, ActionKind.SEND_B):
        peer = s + 1 if kind is ActionKind.SEND_F else s - 1
        mailbox[kind, m, peer] = runner.outgoing(action)
        runner.bytes_sent += sum(_bytes_across(t, meshes[s], meshes[peer])
                                 for t in mailbox[kind, m, peer])
    elif kind in (ActionKind.RECV_F, ActionKind.RECV_B):
        sent = ActionKind.SEND_F if kind is ActionKind.RECV_F else ActionKind.SEND_B
        if (sent, m, s) not in mailbox:
            return False
        peer = programs.stages[s - 1 if kind is ActionKind.RECV_F else s + 1]
        names = peer.send_forward if kind is ActionKind.RECV_F else peer.send_backward
        runner.incoming(action, names, mailbox.pop((sent, m, s)))
    elif kind is ActionKind.UPDATE:
        # gradients another stage's update reads arrive once every backward has run
        pending = [(src, name) for src, dst, name in programs.grad_transfers if dst == s]
        if any(len(runners[src].backward_done) < runners[src].microbatches
               for src, _ in pending):
            return False
        received = {name: runners[src].grad_sums[name] for src, name in pending}
        for src, name in pending:  # sent by the stage that summed them
            runners[src].bytes_sent += _bytes_across(received[name], meshes[src], meshes[s])
        start = time.perf_counter()
        runner.update(received)
        runner.spans.append((action, start, time.perf_counter()))
    else:
        runner.compute(action)
    return True


# ------------------------------------------------------------------ one process per device

def run_multiprocess(programs: PipelinePrograms, schedule: Schedule,
                     state: Mapping[str, torch.Tensor],
                     inputs: Sequence[Mapping[str, torch.Tensor]],
                     timeout: float = 120.0,
                     sharded: Mapping[int, Mapping[str, Any]] | None = None,
                     timed_steps: int = 0, warmup: int = 0) -> PipelineRun:
    """One step with one process per device over gloo, a job of `runtime.jobs` (the programs
    travel through its folder as IR text): the devices of stage s are the global ranks of its
    sub-mesh (`stage_meshes`), each runs its stage's action list and times every action (the
    measured timeline).

    A stage in `sharded` runs each phase's SPMD program, every device its own part, the
    collectives over process groups of the stage's sub-mesh. A tensor crosses between stages
    as tiles (`graphpar.ir.cross_mesh`): each tile once from one sending device to one
    receiving device, then an all-gather inside the receiving sub-mesh.

    With `timed_steps`, the same processes then run `warmup` untimed and `timed_steps` timed
    steps more, each from the starting state, every rank starting it together: the run's
    `step_times` (wall seconds per step and rank) and `stage_compute_seconds` (each stage's
    forward and backward seconds per step, on its first device)."""
    validate(schedule)
    stages = len(programs.stages)
    meshes = stage_meshes(stages, sharded)
    world = sum(mesh.size for mesh in meshes)
    with Job(world, "graphpar.runtime.pipeline:PipelineWorker", prefix="pipeline",
             timeout=timeout, name="pipeline") as job:
        describe_job(job.folder, programs, schedule, state, inputs, sharded)
        results = job.call("run")
        timings = job.call("time_steps", timed_steps, warmup) if timed_steps else []
    leads = [results[mesh.device_ids[0]] for mesh in meshes]
    for mesh in meshes:  # the devices of a stage end the step with the same results
        for rank in mesh.device_ids[1:]:
            _check_replica(results[mesh.device_ids[0]], results[rank], mesh.device_ids[0], rank)
    runners = [FinishedStage.of(r) for r in leads]
    start = min((span[2] for r in results for span in r["spans"]), default=0.0)
    spans = [Span(r["stage"], Action(ActionKind(kind), r["stage"], mb), t0 - start, t1 - start,
                  rank=rank)
             for rank, r in enumerate(results) for kind, mb, t0, t1 in r["spans"]]

    def per_stage(key: str) -> list[int]:
        return [int(sum(results[r][key] for r in mesh.device_ids)) for mesh in meshes]

    run = PipelineRun(assemble_outputs(programs.graph, runners, len(inputs)),
                      per_stage("bytes_sent"), spans, per_stage("intra_stage_bytes"),
                      gathered_bytes=per_stage("gathered_bytes"),
                      bytes_counted=per_stage("bytes_counted"))
    if timings:
        from graphpar.runtime.program import StepTimes

        run.step_times = StepTimes([t["wall"] for t in timings], [t["cpu"] for t in timings],
                                   warmup)
        run.stage_compute_seconds = [timings[mesh.device_ids[0]]["compute"] for mesh in meshes]
    return run


def describe_job(folder: Any, programs: PipelinePrograms, schedule: Schedule,
                 state: Mapping[str, torch.Tensor],
                 inputs: Sequence[Mapping[str, torch.Tensor]],
                 sharded: Mapping[int, Mapping[str, Any]] | None = None,
                 microbatches: int | None = None, **extra: Any) -> list[Mesh]:
    """Write what a :class:`PipelineWorker` reads into a job's `folder` (a `JobFolder`): each
    stage's programs as IR text, its part of `state` and the microbatch `inputs` (none: a
    launcher that feeds every step its own, `microbatches` of them), its sub-mesh and action
    list; `extra` goes into the description as it is. Returns the stages' sub-meshes."""
    meshes = stage_meshes(len(programs.stages), sharded)
    job_stages = []
    for program in programs.stages:
        s = program.stage
        graphs = {phase: folder.write_graph(f"stage{s}_{phase}.gpir", g)
                  for phase in PHASES if (g := program.program(phase)) is not None}
        spmd = {phase: folder.write_graph(f"stage{s}_{phase}_spmd.gpir",
                                          planned.device_program)
                for phase, planned in (sharded or {}).get(s, {}).items()}
        needed = {v.name for g in program.graphs() for v in g.inputs}
        folder.save(f"tensors{s}.pt",
                    {"state": {k: t for k, t in state.items() if k in needed},
                     "inputs": list(inputs)})
        job_stages.append({
            **mesh_entry(meshes[s]),
            "graphs": graphs,
            "spmd": spmd,
            "send_forward": list(program.send_forward),
            "send_backward": list(program.send_backward),
            "keep_after_forward": sorted(program.keep_after_forward),
            "grads": list(program.grads),
            "actions": [[a.kind.value, a.microbatch] for a in schedule[s]],
            # the gradient sums this stage sends at UPDATE (by receiving stage) and those
            # it receives (by sending stage), each stage's in grad_transfers order
            "grads_out": [[dst, n] for src, dst, n in programs.grad_transfers if src == s],
            "grads_in": [[src, n] for src, dst, n in programs.grad_transfers if dst == s],
        })
    folder.describe({"microbatches": len(inputs) if microbatches is None else microbatches,
                     "stages": job_stages,
                     "types": {n: [list(t.shape), str(t.dtype).removeprefix("torch.")]
                               for n, t in programs.types.items()}, **extra})
    return meshes


def _check_replica(lead: dict, other: dict, lead_rank: int, rank: int) -> None:
    for key in ("losses", "grad_outputs", "updates"):
        for name, t in lead[key].items():
            if not torch.equal(t, other[key][name]):
                raise BackendError(f"ranks {lead_rank} and {rank} play devices of the same "
                                   f"pipeline stage but ended the step with different "
                                   f"{key.replace('_', ' ')} {name!r}")


@dataclass
class FinishedStage:
    """What a stage's worker replies: as much of a StageRunner as `assemble_outputs` reads."""

    losses: dict
    grad_outputs: dict
    updates: dict

    @classmethod
    def of(cls, result: Mapping[str, Any]) -> FinishedStage:
        """The part of a worker's reply (a dict with these keys, and more) that is this."""
        return cls(result["losses"], result["grad_outputs"], result["updates"])

    def mean_loss(self) -> torch.Tensor | None:
        return mean_loss(self.losses)


@dataclass(frozen=True)
class DevicePhase:
    """A sharded phase as a worker reads it back from its job folder: what the runtime reads
    of `graphpar.passes.pipeline.lower_mpmd.ShardedPhase` (its device program, on its
    sub-mesh)."""

    device_program: Graph
    mesh: Any

    @classmethod
    def read(cls, folder: Any, entry: Mapping[str, Any]) -> DevicePhase:
        """The device program `JobFolder.write_graph` wrote, on the mesh it declares."""
        graph = folder.read_graph(entry)
        return cls(graph, graph.mesh)


class ReceivesAhead:
    """The receives of an action list, each posted ahead by `post(action)`: the first RECV_F
    and the first RECV_B at once, the next of a kind as soon as the last one is taken. A send
    whose receive is already posted leaves from its `isend`; one posted later waits for the
    sending process to notice the receive (docs/pipeline.md, *The hand-over*)."""

    def __init__(self, actions: Sequence[Action], post: Callable[[Action], Any]) -> None:
        self._post = post
        self._next = {kind: iter([a for a in actions if a.kind is kind])
                      for kind in (ActionKind.RECV_F, ActionKind.RECV_B)}
        self._posted: dict[tuple[ActionKind, int], Any] = {}
        for kind in self._next:
            self._post_next(kind)

    def _post_next(self, kind: ActionKind) -> None:
        action = next(self._next[kind], None)
        if action is not None:
            self._posted[kind, action.microbatch] = self._post(action)

    def take(self, action: Action) -> Any:
        """What `post` returned for RECV `action`; posts the next receive of its kind."""
        posted = self._posted.pop((action.kind, action.microbatch))
        self._post_next(action.kind)
        return posted


class PipelineWorker(JobWorker):
    """Global rank `rank` of a pipeline job: one device of one stage's sub-mesh; its stage's
    runner, its action list, its tiles sent and received over gloo."""

    def __init__(self, jobdir, rank: int, world: int) -> None:
        from graphpar.runtime.gloo import GlooCommunicator, new_process_groups

        super().__init__(jobdir, rank, world)
        job, folder = self.job, self.folder
        self.meshes = [folder.mesh(spec) for spec in job["stages"]]
        if sum(mesh.size for mesh in self.meshes) != world:
            raise BackendError(f"WORLD_SIZE={world} but the pipeline's sub-meshes have "
                               f"{sum(m.size for m in self.meshes)} devices")
        self.stage = next(s for s, mesh in enumerate(self.meshes) if rank in mesh.device_ids)
        # new_group is collective over the world: every rank makes every stage's groups, in
        # stage order, and keeps its own stage's
        for s, mesh in enumerate(self.meshes):
            if s == self.stage:
                self.comm = GlooCommunicator(mesh, global_ranks=mesh.device_ids)
            else:
                new_process_groups(mesh, None, mesh.device_ids, rank)
        spec = job["stages"][self.stage]
        graphs = {phase: folder.read_graph(entry) for phase, entry in spec["graphs"].items()}
        self.program = StageProgram(
            self.stage, *(graphs.get(phase) for phase in PHASES),
            send_forward=tuple(spec["send_forward"]), send_backward=tuple(spec["send_backward"]),
            keep_after_forward=frozenset(spec["keep_after_forward"]), grads=tuple(spec["grads"]))
        self.peers = job["stages"]
        self.types = {n: TensorType(tuple(shape), getattr(torch, dtype))
                      for n, (shape, dtype) in job["types"].items()}
        self.actions = [Action(ActionKind(k), self.stage, mb) for k, mb in spec["actions"]]
        self.spec = spec
        self.tensors = folder.load(f"tensors{self.stage}.pt")
        self.sharded = {phase: DevicePhase.read(folder, entry)
                        for phase, entry in spec["spmd"].items()}
        self.microbatches = job["microbatches"]
        self.runner = self._runner()
        self.bytes_across = 0  # the tiles this device sent to other stages
        self.counted_across = 0  # the same as gloo payloads: its packed messages
        self.gathered_bytes = 0  # the all-gathers joining the tiles it received

    def _runner(self) -> StageRunner:
        """A fresh runner of one step from the job's starting state and microbatches."""
        return StageRunner(self.program, self.microbatches, self.tensors["state"],
                           self.tensors["inputs"], self.sharded, comm=self.comm)

    def run(self) -> dict:
        """One step: this device's results, what it sent and its spans."""
        runner = self.runner
        spans = self._step(runner)
        return {"stage": self.stage, "losses": runner.losses,
                "grad_outputs": runner.grad_outputs, "updates": runner.updates,
                "bytes_sent": self.bytes_across, "bytes_counted": self.counted_across,
                "intra_stage_bytes": runner.intra_stage_bytes + self.gathered_bytes,
                "gathered_bytes": self.gathered_bytes, "spans": spans}

    def time_steps(self, steps: int, warmup: int) -> dict:
        """Run `warmup` + `steps` more steps, each from the starting state after a barrier (all
        ranks start together): each timed step's wall seconds and this device's compute
        seconds (its forward and backward actions) and CPU seconds."""
        import torch.distributed as dist

        wall, cpu, compute = [], [], []
        for i in range(warmup + steps):
            runner = self._runner()
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            spans = self._step(runner)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                wall.append(elapsed)
                cpu.append(time.process_time() - start_cpu)
                compute.append(sum(t1 - t0 for kind, _, t0, t1 in spans
                                   if ActionKind(kind) in COMPUTE_KINDS))
        return {"wall": wall, "cpu": cpu, "compute": compute}

    def _step(self, runner: StageRunner) -> list[tuple]:
        """This device's action list for one step; returns its spans (kind, microbatch, start,
        end; wall-clock seconds).

        A stage boundary goes to each receiving device as one message (`send_boundary`,
        every tile bound for that device packed together), tagged with its microbatch (the
        update's gradients: the number of microbatches), so a message meets exactly its
        receive whatever the order. Each receive is posted ahead (`ReceivesAhead`; the
        update's gradients at the start)."""
        spans = []
        ahead = ReceivesAhead(self.actions, lambda a: self._post(
            self._boundary_names(a), a.peer, a.microbatch))
        grads_in = {src: self._post([n for s, n in self.spec["grads_in"] if s == src], src,
                                    self.microbatches)
                    for src in dict.fromkeys(s for s, _ in self.spec["grads_in"])}
        for action in self.actions:
            start = time.time()
            kind, m = action.kind, action.microbatch
            if kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                names = (self.spec["send_forward"] if kind is ActionKind.SEND_F
                         else self.spec["send_backward"])
                self._send(names, runner.outgoing(action), action.peer, m)
            elif kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                names, tensors = ahead.take(action)()
                runner.incoming(action, names, tensors)
            elif kind is ActionKind.UPDATE:
                for dst in dict.fromkeys(d for d, _ in self.spec["grads_out"]):
                    names = [n for d, n in self.spec["grads_out"] if d == dst]
                    self._send(names, [runner.grad_sums[n] for n in names], dst,
                               self.microbatches)
                runner.update({n: t for names, tensors in (take() for take in grads_in.values())
                               for n, t in zip(names, tensors)})
            else:
                runner.compute(action)
            spans.append((kind.value, m, start, time.time()))
        self.comm.finish()
        return spans

    def _boundary_names(self, action: Action) -> list[str]:
        """The tensors a RECV action takes: what its peer stage sends across."""
        key = "send_forward" if action.kind is ActionKind.RECV_F else "send_backward"
        return self.peers[action.peer][key]

    def _plans(self, names: Sequence[str], src: int, dst: int) -> list[TileTransfer]:
        """How each named tensor crosses from stage `src` to stage `dst` (its tiles)."""
        return [tile_transfer(self.types[n], self.meshes[src].device_ids,
                              self.meshes[dst].device_ids) for n in names]

    def _send(self, names: Sequence[str], tensors: Sequence[torch.Tensor], stage: int,
              tag: int) -> None:
        """This device's tiles of `tensors` (whole on every device of its stage) to `stage`:
        one message per receiving device."""
        plans = self._plans(names, self.stage, stage)
        before, counted = self.comm.bytes_sent, self.comm.bytes_counted
        self.comm.send_boundary(list(zip(tensors, plans)), tag)
        self.bytes_across += int(self.comm.bytes_sent - before)
        self.counted_across += int(self.comm.bytes_counted - counted)

    def _post(self, names: Sequence[str], stage: int, tag: int) -> _Arrival:
        """Post the receives of `names` from `stage`; returns what waits for them: this
        device's tiles, each then joined by an all-gather over this stage's sub-mesh."""
        plans = self._plans(names, stage, self.stage)
        message = self.comm.post_boundary(plans, tag)

        def take() -> tuple[Sequence[str], list[torch.Tensor]]:
            tensors = []
            for plan, t in zip(plans, message.wait()):
                if plan.gathered:
                    before = self.comm.bytes_sent
                    t = self.comm.all_gather(t, tuple(range(self.comm.mesh.ndim)), plan.dim)
                    self.gathered_bytes += int(self.comm.bytes_sent - before)
                tensors.append(t)
            return names, tensors
        return take
