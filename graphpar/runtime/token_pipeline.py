"""Token-pipelined training (TeraPipe) on the pipeline runtime: work items are (microbatch,
slice) pairs, each stage keeping the keys and values of a sequence's earlier slices.

A :class:`TokenStage` is one stage: a `SliceRunner` (a `StageRunner` over one slice's F and B
programs) per token slice, and the whole pipeline's update program. An action's `microbatch`
is a work item (`schedules.token_unit`); the stage hands it to the runner of its slice, for
that microbatch. Between the slices of one stage, nothing crosses a process boundary:

- F of slice j returns, per attention layer of the stage, the cache `key.i` / `value.i` over
  [0, c_j + l_j); it becomes the `past_key.i` / `past_value.i` input of slice j + 1's F and B;
- B of slice j returns the gradient of the step's loss into its `past_key.i` / `past_value.i`,
  i.e. into the cache slice j - 1 returned: it becomes slice j - 1's `grad_key.i` input, which
  its B adds to what its own attention contributes (the gradient of an earlier slice's keys
  and values accumulates over every later slice, through each cache in turn).

Parameter gradients are summed over slices and microbatches; UPDATE divides by the number of
microbatches (the slices' losses are already weighted by length) and runs U once. Transfers
between stages are per item, by the names of that slice's programs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphpar.cost.timeline import Span
from graphpar.errors import GraphparError, ScheduleError
from graphpar.ir.graph import Graph, OutputRole
from graphpar.ir.pipeline_programs import StageProgram, TokenPrograms
from graphpar.ir.schedule import Action, ActionKind, Schedule, token_unit, validate
from graphpar.runtime.jobs import Job, JobWorker
from graphpar.runtime.pipeline import (
    DevicePhase,
    FinishedStage,
    PipelineRun,
    ReceivesAhead,
    StageRunner,
    assemble_outputs,
    mean_loss,
    take_turns,
)

__all__ = ["SliceRunner", "TokenPipelineWorker", "TokenStage", "describe_token_job",
           "run_tokens_in_process", "run_tokens_multiprocess", "slice_inputs"]


class SliceRunner(StageRunner):
    """A StageRunner for one token slice: the caches its F returns and the gradients its B
    returns into earlier slices' caches are kept per microbatch for the neighbouring slices,
    not reported as the step's outputs."""

    def next_step(self, state: Mapping[str, torch.Tensor],
                  inputs: Sequence[Mapping[str, torch.Tensor]]) -> None:
        super().next_step(state, inputs)
        self.kv: list[dict[str, torch.Tensor]] = [{} for _ in range(self.microbatches)]

    def _keep(self, role: OutputRole, target: str | None, t: torch.Tensor, env: dict,
              m: int) -> None:
        if role in (OutputRole.OUTPUT, OutputRole.GRAD) and _is_cache(target):
            self.kv[m][target] = t
        else:
            super()._keep(role, target, t, env, m)


_CACHE = re.compile(r"(past_)?(key|value)\.\d+")


def _is_cache(name: str | None) -> bool:
    """key.i / value.i (a slice's cache), or past_key.i / past_value.i (its gradient)."""
    return name is not None and _CACHE.fullmatch(name) is not None


def slice_inputs(inputs: Sequence[Mapping[str, torch.Tensor]], names: Sequence[str],
                 token_slices: Sequence[int]) -> list[list[dict[str, torch.Tensor]]]:
    """Per slice, per microbatch, the slice's `input_ids` and `target`: the whole step's two
    user inputs `names` (token ids, then targets) cut along the sequence (dimension 1)."""
    if len(names) != 2:
        raise GraphparError(f"token slicing runs a causal LM's step on token ids and targets; "
                            f"this step takes {len(names)} inputs ({', '.join(names)})")
    out, offset = [], 0
    for length in token_slices:
        span = slice(offset, offset + length)
        out.append([{"input_ids": mb[names[0]][:, span].contiguous(),
                     "target": mb[names[1]][:, span].contiguous()} for mb in inputs])
        offset += length
    return out


class TokenStage:
    """One stage of a token-pipelined step (see the module docstring). Offers what the
    drivers and `assemble_outputs` read of a StageRunner."""

    def __init__(self, stage: int, slices: Sequence[StageProgram], update: Graph | None,
                 grad_param: Mapping[str, str], microbatches: int,
                 state: Mapping[str, torch.Tensor],
                 inputs: Sequence[Sequence[Mapping[str, torch.Tensor]]],
                 sharded: Mapping[str, Any] | None = None) -> None:
        """`sharded`: for a stage on a sub-mesh of several devices, "slices" (per slice, phase
        -> `lower_mpmd.ShardedPhase`) and "U" (the update's), run as SPMD programs there."""
        self.stage, self.microbatches, self.slices = stage, microbatches, len(slices)
        sharded = dict(sharded or {})
        per_slice = sharded.get("slices") or [None] * len(slices)
        # each slice's runner reads its own copy of the per-microbatch dicts: caches land there
        self.runners = [SliceRunner(p, microbatches, state, [dict(mb) for mb in inputs[j]],
                                    per_slice[j])
                        for j, p in enumerate(slices)]
        # U runs as a microbatch pipeline's stage runs it (on its sub-mesh when sharded)
        self.update_runner = (StageRunner(StageProgram(stage, None, None, None, None, update),
                                          microbatches, state, [],
                                          {"U": sharded["U"]} if "U" in sharded else None)
                              if update is not None else None)
        self.grad_param_of = {v.name: grad_param[v.name] for v in
                              (update.inputs if update is not None else ()) if v.name in grad_param}
        self.updates: dict[str, torch.Tensor] = {}
        self.items_backward = 0  # backward items done: received gradients wait for all
        self.spans: list[tuple[Action, float, float]] = []
        # bytes this stage sent to others, each tensor's own: activations and their
        # gradients as they leave, plus summed gradients sent to another stage's update
        self.sent_bytes = 0

    def next_step(self, state: Mapping[str, torch.Tensor],
                  inputs: Sequence[Sequence[Mapping[str, torch.Tensor]]]) -> None:
        """Start a step from `state` on `inputs` (per slice, per microbatch: `slice_inputs`),
        keeping every runner's interpreters: what a training run calls between steps."""
        for j, runner in enumerate(self.runners):
            runner.next_step(state, [dict(mb) for mb in inputs[j]])
        if self.update_runner is not None:
            self.update_runner.next_step(state, [])
        self.updates = {}
        self.items_backward = 0
        self.spans = []
        self.sent_bytes = 0

    def _runner(self, action: Action) -> tuple[SliceRunner, Action, int, int]:
        m, j = token_unit(action.microbatch, self.slices)
        return self.runners[j], Action(action.kind, action.stage, m), m, j

    def compute(self, action: Action) -> None:
        start = time.perf_counter()
        runner, local, m, j = self._runner(action)
        runner.compute(local)
        made = runner.kv[m]
        if action.kind is ActionKind.F and j + 1 < self.slices:
            # this slice's cache is the next slice's past; its F and B read it
            self.runners[j + 1].inputs[m].update({f"past_{n}": t for n, t in made.items()})
        elif action.kind is ActionKind.B:
            self.items_backward += 1
            if j > 0:  # the gradient into the past is the previous slice's cache gradient
                self.runners[j - 1].inputs[m].update(
                    {f"grad_{n.removeprefix('past_')}": t for n, t in made.items()})
            mine = runner.inputs[m]  # this slice is done: drop its caches and their gradients
            for name in [n for n in mine if n.startswith(("past_", "grad_"))]:
                del mine[name]
        runner.kv[m] = {}
        self.spans.append((action, start, time.perf_counter()))

    def outgoing(self, action: Action) -> list[torch.Tensor]:
        runner, local, _, _ = self._runner(action)
        tensors = runner.outgoing(local)
        self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)
        return tensors

    def incoming(self, action: Action, names: Sequence[str],
                 tensors: Sequence[torch.Tensor]) -> None:
        runner, local, _, _ = self._runner(action)
        runner.incoming(local, names, tensors)

    def update(self, received: Mapping[str, torch.Tensor] | None = None) -> None:
        """U on the mean gradients: this stage's sums over slices and microbatches plus those
        `received` (by parameter) from stages whose backward made them."""
        start = time.perf_counter()
        if self.update_runner is not None:
            sums = dict(self.grad_outputs)
            for name, t in (received or {}).items():
                sums[name] = sums[name] + t if name in sums else t
            missing = sorted({p for p in self.grad_param_of.values() if p not in sums})
            if missing:
                raise GraphparError(f"token pipeline stage {self.stage}: no gradient of "
                                    f"{missing[0]} reached its update")
            # the update runner divides by the microbatches, as for a microbatch pipeline
            self.update_runner.grad_sums = {n: sums[p] for n, p in self.grad_param_of.items()}
            self.update_runner.update()
            self.updates = self.update_runner.updates
        self.spans.append((Action(ActionKind.UPDATE, self.stage, None), start,
                           time.perf_counter()))

    # what assemble_outputs and PipelineRun read
    @property
    def grad_outputs(self) -> dict[str, torch.Tensor]:
        sums: dict[str, torch.Tensor] = {}
        for runner in self.runners:
            for name, t in runner.grad_outputs.items():
                sums[name] = sums[name] + t if name in sums else t
        return sums

    @property
    def losses(self) -> dict[int, torch.Tensor]:
        """Per microbatch, the sum of its slices' losses (each weighted by its length)."""
        per_slice = [r.losses for r in self.runners]
        if not any(per_slice):
            return {}
        return {m: sum(losses[m] for losses in per_slice) for m in range(self.microbatches)}

    def mean_loss(self) -> torch.Tensor | None:
        return mean_loss(self.losses)

    @property
    def intra_stage_bytes(self) -> int:
        """What the sub-mesh's collectives sent, by the plan's definition (0 unless
        sharded)."""
        runners = [*self.runners, *([self.update_runner] if self.update_runner else [])]
        return sum(r.intra_stage_bytes for r in runners)

    @property
    def bytes_sent(self) -> int:
        return self.sent_bytes

    @property
    def tensors_left(self) -> int:
        return sum(len(env) for r in self.runners for env in r.env) + sum(
            1 for r in self.runners for mb in r.inputs for n in mb
            if n.startswith(("past_", "grad_")))


def _names(programs: TokenPrograms, stage: int, j: int, kind: ActionKind) -> tuple[str, ...]:
    """What stage `stage` sends for slice j: forward activations or backward gradients."""
    peer = programs.slices[j].programs.stages[stage]
    return peer.send_forward if kind is ActionKind.SEND_F else peer.send_backward


def _stages(programs: TokenPrograms, state, inputs, names, sharded) -> list[TokenStage]:
    per_slice = slice_inputs(inputs, names, programs.token_slices)
    return [TokenStage(s, [sl.programs.stages[s] for sl in programs.slices], programs.update(s),
                       programs.grad_param, len(inputs), state, per_slice,
                       (sharded or {}).get(s))
            for s in range(programs.stages)]


def run_tokens_in_process(programs: TokenPrograms, schedule: Schedule,
                          state: Mapping[str, torch.Tensor],
                          inputs: Sequence[Mapping[str, torch.Tensor]],
                          sharded: Mapping[int, Mapping[str, Any]] | None = None
                          ) -> PipelineRun:
    """One token-pipelined step with every stage in this process: the stages take turns, each
    running actions until it waits for a transfer that has not been sent (as
    `pipeline.run_in_process` does for microbatches). `programs`: every slice's stage
    programs (`passes.pipeline.token_programs.split_token_slices`); `inputs`: per microbatch,
    the whole step's user tensors by name; `sharded`: stage -> what `TokenStage` takes, for
    stages on a sub-mesh of several devices (run in lockstep in this process)."""
    validate(schedule)
    if len(schedule) != programs.stages:
        raise ScheduleError(f"the schedule has {len(schedule)} stages, the programs "
                            f"{programs.stages}")
    names = [v.name for v in programs.whole.graph.inputs if v.role.value == "input"]
    stages = _stages(programs, state, inputs, names, sharded)
    slices = len(programs.slices)
    mailbox: dict[tuple[ActionKind, int, int], list[torch.Tensor]] = {}
    def step(s: int, a: Action) -> bool:
        if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            mailbox[a.kind, a.microbatch, a.peer] = stages[s].outgoing(a)
        elif a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            sent = ActionKind.SEND_F if a.kind is ActionKind.RECV_F else ActionKind.SEND_B
            if (sent, a.microbatch, s) not in mailbox:
                return False
            j = token_unit(a.microbatch, slices)[1]
            stages[s].incoming(a, _names(programs, a.peer, j, sent),
                               mailbox.pop((sent, a.microbatch, s)))
        elif a.kind is ActionKind.UPDATE:
            pending = [(src, p) for src, dst, p in programs.grad_transfers if dst == s]
            if any(stages[src].items_backward < len(inputs) * slices for src, _ in pending):
                return False
            received: dict[str, torch.Tensor] = {}
            for src, p in pending:
                t = stages[src].grad_outputs[p]
                received[p] = received[p] + t if p in received else t
                stages[src].sent_bytes += t.numel() * t.element_size()
            stages[s].update(received)
        else:
            stages[s].compute(a)
        return True

    start = take_turns(schedule, step, "token pipeline")
    spans = [Span(st.stage, a, t0 - start, t1 - start, rank=st.stage)
             for st in stages for a, t0, t1 in st.spans]
    return PipelineRun(assemble_outputs(programs.whole.graph, stages, len(inputs)),
                       [st.bytes_sent for st in stages], spans,
                       [st.intra_stage_bytes for st in stages],
                       tensors_left=sum(st.tensors_left for st in stages))


# ------------------------------------------------------------------ one process per stage

def run_tokens_multiprocess(programs: TokenPrograms, schedule: Schedule,
                            state: Mapping[str, torch.Tensor],
                            inputs: Sequence[Mapping[str, torch.Tensor]],
                            timeout: float = 120.0,
                            sharded: Mapping[int, Mapping[str, Any]] | None = None
                            ) -> PipelineRun:
    """One token-pipelined step with each stage in its own process over gloo, a job of
    `runtime.jobs`; the programs travel through its folder as IR text, transfers are
    point-to-point, one packed message per item (the named tensors of its slice).

    A stage in `sharded` (as `run_tokens_in_process` takes it) ships its phases' SPMD device
    programs as IR text too and runs them for every device of its sub-mesh in lockstep inside
    the stage's process (as the microbatch pipeline does: not yet one process per device)."""
    validate(schedule)
    stages = programs.stages
    with Job(stages, "graphpar.runtime.token_pipeline:TokenPipelineWorker", prefix="tokens",
             timeout=timeout, name="token pipeline stage") as job:
        describe_token_job(job.folder, programs, schedule, state, inputs, sharded)
        results = job.call("run")
    runners = [FinishedStage.of(r) for r in results]
    begin = min((span[2] for r in results for span in r["spans"]), default=0.0)
    spans = [Span(s, Action(ActionKind(kind), s, item), t0 - begin, t1 - begin, rank=s)
             for s, r in enumerate(results) for kind, item, t0, t1 in r["spans"]]
    return PipelineRun(assemble_outputs(programs.whole.graph, runners, len(inputs)),
                       [r["bytes_sent"] for r in results], spans,
                       bytes_counted=[r["bytes_counted"] for r in results])


def describe_token_job(folder: Any, programs: TokenPrograms, schedule: Schedule,
                       state: Mapping[str, torch.Tensor],
                       inputs: Sequence[Mapping[str, torch.Tensor]],
                       sharded: Mapping[int, Mapping[str, Any]] | None = None,
                       microbatches: int | None = None, **extra: Any) -> None:
    """Write what a :class:`TokenPipelineWorker` reads into a job's `folder` (a `JobFolder`):
    every slice's stage programs and every stage's update as IR text, the state and the
    microbatch `inputs` (none: a launcher that feeds every step its own, `microbatches` of
    them), each stage's action list; `extra` goes into the description as it is."""
    names = [v.name for v in programs.whole.graph.inputs if v.role.value == "input"]
    sharded = sharded or {}

    def write(graph: Graph | None, stem: str) -> dict | None:
        return None if graph is None else folder.write_graph(f"{stem}.gpir", graph)

    def write_spmd(phases: Mapping[str, Any] | None, stem: str) -> dict:
        return {phase: write(planned.device_program, f"{stem}_{phase}_spmd")
                for phase, planned in (phases or {}).items()}

    description: dict[str, Any] = {
        "microbatches": len(inputs) if microbatches is None else microbatches, "names": names,
        "token_slices": programs.token_slices, "grad_param": programs.grad_param,
        "slices": [], "stages": [], **extra}
    for j, sl in enumerate(programs.slices):
        description["slices"].append({"types": {n: [list(t.shape), str(t.dtype).removeprefix(
            "torch.")] for n, t in sl.programs.types.items()}, "stages": []})
        for p in sl.programs.stages:
            description["slices"][j]["stages"].append({
                "F": write(p.forward, f"slice{j}_stage{p.stage}_F"),
                "B": write(p.backward, f"slice{j}_stage{p.stage}_B"),
                "send_forward": list(p.send_forward), "send_backward": list(p.send_backward),
                "keep_after_forward": sorted(p.keep_after_forward),
                "grads": list(p.grads),
                "spmd": write_spmd(_sharded_slice(sharded, p.stage, j),
                                   f"slice{j}_stage{p.stage}")})
    for s in range(programs.stages):
        description["stages"].append({
            "U": write(programs.update(s), f"stage{s}_U"),
            "U_spmd": write_spmd({"U": sharded[s]["U"]} if "U" in sharded.get(s, {})
                                 else None, f"stage{s}"),
            "actions": [[a.kind.value, a.microbatch] for a in schedule[s]],
            "grads_out": [[dst, p] for src, dst, p in programs.grad_transfers if src == s],
            "grads_in": [[src, p] for src, dst, p in programs.grad_transfers if dst == s]})
    folder.save("tensors.pt", {"state": dict(state), "inputs": list(inputs)})
    folder.describe(description)


def _sharded_slice(sharded: Mapping[int, Mapping[str, Any]], stage: int, j: int) -> dict:
    """Slice j's sharded phases on `stage` (empty for a stage on one device)."""
    slices = sharded.get(stage, {}).get("slices")
    return dict(slices[j]) if slices else {}


class TokenPipelineWorker(JobWorker):
    """Rank `rank` of a token pipeline job: stage `rank`'s TokenStage, its action list, gloo
    transfers."""

    def __init__(self, jobdir, rank: int, world: int) -> None:
        from graphpar.ir.types import TensorType

        super().__init__(jobdir, rank, world)
        job, folder = self.job, self.folder

        def read(entry: dict | None) -> Graph | None:
            return None if entry is None else folder.read_graph(entry)

        def read_spmd(spmd: dict) -> dict:
            return {phase: DevicePhase.read(folder, entry) for phase, entry in spmd.items()
                    if entry is not None}

        self.slices = job["slices"]
        loaded, sharded_slices = [], []
        for sl in self.slices:
            spec = sl["stages"][rank]
            loaded.append(StageProgram(rank, read(spec["F"]), read(spec["B"]), None, None, None,
                                       tuple(spec["send_forward"]), tuple(spec["send_backward"]),
                                       frozenset(spec["keep_after_forward"]),
                                       tuple(spec["grads"])))
            sharded_slices.append(read_spmd(spec["spmd"]))
        self.types = [{n: TensorType(tuple(shape), getattr(torch, dtype))
                       for n, (shape, dtype) in sl["types"].items()} for sl in self.slices]
        self.spec = job["stages"][rank]
        self.actions = [Action(ActionKind(k), rank, w) for k, w in self.spec["actions"]]
        tensors = folder.load("tensors.pt")
        per_slice = slice_inputs(tensors["inputs"], job["names"], job["token_slices"])
        sharded = {"slices": sharded_slices, **read_spmd(self.spec["U_spmd"])}
        self.stage = TokenStage(rank, loaded, read(self.spec["U"]), job["grad_param"],
                                job["microbatches"], tensors["state"], per_slice, sharded)
        self.tensors = tensors
        self._comm = None

    def run(self) -> dict:
        """One step: this stage's results, what it sent and its spans."""
        spans = self._step()
        stage = self.stage
        return {"losses": stage.losses, "grad_outputs": stage.grad_outputs,
                "updates": stage.updates, "bytes_sent": stage.bytes_sent,
                "bytes_counted": int(self.comm.bytes_counted), "spans": spans}

    @property
    def comm(self) -> Any:
        """The world as a mesh with no groups (none needed): its sends and receives, an
        item's boundary as one message tagged by the item, the gradients tagged after every
        item."""
        if self._comm is None:
            from graphpar.ir.mesh import Mesh
            from graphpar.runtime.gloo import GlooCommunicator

            self._comm = GlooCommunicator(Mesh((self.world,), tuple(range(self.world))),
                                          axes=())
        return self._comm

    def _step(self) -> list[tuple]:
        """This stage's action list for one step; returns its spans (kind, item, start, end;
        wall-clock seconds)."""
        from graphpar.ir.types import TensorType

        comm = self.comm
        stage, spans = self.stage, []
        slices = len(self.slices)
        grads_tag = stage.microbatches * slices

        def names(action: Action) -> list[str]:
            key = "send_forward" if action.kind is ActionKind.RECV_F else "send_backward"
            return self.slices[token_unit(action.microbatch, slices)[1]]["stages"][
                action.peer][key]

        def post(action: Action) -> tuple[list[str], Any]:
            types = self.types[token_unit(action.microbatch, slices)[1]]
            return names(action), comm.post_packed([types[n] for n in names(action)],
                                                   action.peer, action.microbatch)

        ahead = ReceivesAhead(self.actions, post)
        held = stage.update_runner.state if stage.update_runner else {}
        grads_in = {}
        for src in dict.fromkeys(src for src, _ in self.spec["grads_in"]):
            params = [p for s, p in self.spec["grads_in"] if s == src]
            for param in params:
                if param not in held:
                    raise GraphparError(f"token pipeline stage {self.rank}: receives the "
                                        f"gradient of {param} but does not hold it")
            grads_in[src] = params, comm.post_packed([TensorType.of(held[p]) for p in params],
                                                     src, grads_tag)
        for action in self.actions:
            start = time.time()
            kind, item = action.kind, action.microbatch
            if kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                comm.send_packed(stage.outgoing(action), action.peer, item)
            elif kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                received_names, message = ahead.take(action)
                stage.incoming(action, received_names, message.wait())
            elif kind is ActionKind.UPDATE:
                sums = stage.grad_outputs
                for dst in dict.fromkeys(dst for dst, _ in self.spec["grads_out"]):
                    tensors = [sums[p] for d, p in self.spec["grads_out"] if d == dst]
                    comm.send_packed(tensors, dst, grads_tag)
                    stage.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)
                arrived = {src: iter(message.wait()) for src, (_, message) in grads_in.items()}
                received: dict[str, torch.Tensor] = {}
                for src, param in self.spec["grads_in"]:  # summed in the job's order
                    t = next(arrived[src])
                    received[param] = received[param] + t if param in received else t
                stage.update(received)
            else:
                stage.compute(action)
            spans.append((kind.value, item, start, time.time()))
        comm.finish()
        return spans
