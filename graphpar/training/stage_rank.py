"""One device of a pipelined training run: its stage's part of the state, step after step.

`StageTrainWorker` is the pipeline runtime's worker (`graphpar.runtime.pipeline.PipelineWorker`:
its stage's programs, its action list, tiles over gloo) kept for the whole run. Each step it
reads what its stage's programs read of the step's batch (the first stage the inputs, the loss
stage the targets, a stage between them nothing), cuts it into microbatches, runs its action
list on its stage's runner (`StageRunner.next_step`: the interpreters are kept), keeps the
updates, and sends the updated tensors another stage reads (a tied embedding, Adam's step count)
to it. The loss, made on the last stage, is broadcast so rank 0 reports it. `TokenTrainWorker`
does the same on the token pipeline runtime's worker
(`graphpar.runtime.token_pipeline.TokenPipelineWorker`: one process per stage, each microbatch
cut into token slices); `StageRanks` is what the two share.

A stage's state is whole on each of its devices (a stage on several devices shards each phase
from whole tensors), so its checkpoint entries are DTensors with `Replicate()` on the stage's
sub-mesh: DCP stores them as whole tensors, which a plain run's sharded plan reshards on load,
and loads any saved layout into them whole.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from graphpar.runtime.pipeline import PipelineWorker, split_microbatches
from graphpar.runtime.token_pipeline import TokenPipelineWorker, slice_inputs
from graphpar.training.rank import RankSteps, batch_source, plan_from_description, train_in_job

STATE_TAG_OFFSET = 1  # tag of the updated-state message: after the microbatches' and gradients'


def state_transfers(graphs: list[list]) -> list[tuple[int, int, str]]:
    """(from stage, to stage, name) for each state tensor a stage updates that another stage's
    programs read (`graphs`: per stage, its programs): after every step it is sent there, or
    that stage would read a stale copy."""
    from graphpar.ir.graph import OutputRole

    updated: dict[str, int] = {}
    for stage, programs in enumerate(graphs):
        for graph in programs:
            for out in graph.outputs:
                if out.role is OutputRole.UPDATE:
                    updated[out.target] = stage
    transfers = set()
    for stage, programs in enumerate(graphs):
        for name in {v.name for g in programs for v in g.inputs}:
            if name in updated and updated[name] != stage:
                transfers.add((updated[name], stage, name))
    return sorted(transfers)


def stage_graphs(pipe) -> list[list]:
    """Per stage, every program of a pipeline (`compiler.pipelined.PipelineCompiled`) or a
    token pipeline (`compiler.token_pipelined.TokenPipeline`: each slice's and the update)."""
    programs = getattr(pipe, "programs", None)
    if hasattr(programs, "slices"):
        return [[g for sl in programs.slices for g in sl.programs.stages[s].graphs()]
                + [g for g in (programs.update(s),) if g is not None]
                for s in range(programs.stages)]
    return [list(p.graphs()) for p in pipe.programs.stages]


def loss_stage(graphs: list[list]) -> int:
    """The stage whose forward makes the loss (`graphs`: per stage, its programs)."""
    from graphpar.ir.graph import OutputRole

    for stage, programs in enumerate(graphs):
        if any(out.role is OutputRole.LOSS for g in programs for out in g.outputs):
            return stage
    return len(graphs) - 1


class StageRanks(RankSteps):
    """What a device of a pipelined run adds to its pipeline runtime's worker: the plan and
    data from the job's ``train`` entry, the loss broadcast, checkpoints of its stage's
    tensors, the job's `train` command. The worker sets `stage_devices` (its stage's global
    ranks) and calls `_setup_training` once built."""

    job: dict
    folder: object
    stage_devices: tuple[int, ...]

    def _setup_training(self, state: dict[str, torch.Tensor], reads: set[str]) -> None:
        """`reads`: the names of the step's inputs and targets this stage's programs read."""
        train = self.job["train"]
        self.plan = plan_from_description(train["plan"], "", self.folder.load("constants.pt"))
        self.data = train["data"]
        self.batches = batch_source(self.data, self.plan)
        self.names = list(self.plan.inputs)
        # positions in (*inputs, *targets) this stage reads; the rest it holds as zeros
        self.reads = tuple(k for k, name in enumerate(self.names) if name in reads)
        self.loss_rank = train["loss_rank"]
        self.state = dict(state)
        self.transfers = [tuple(t) for t in train["state_transfers"]]
        self.device_mesh = None

    def _batch(self, index: int, microbatches: int) -> list[dict[str, torch.Tensor]]:
        """Step `index`'s batch cut into microbatches, by the step's input names: only what
        this stage reads is read (`reads`), the other tensors are zeros it never looks at."""
        if self.reads:
            inputs, targets = self.batches(index, parts=self.reads)
            tensors = (*inputs, *targets)
        else:
            tensors = tuple(torch.zeros(t.shape, dtype=t.torch_dtype)
                            for t in self.plan.inputs.values())
        return split_microbatches(dict(zip(self.names, tensors)), microbatches)

    def _keep(self, updates: dict[str, torch.Tensor]) -> None:
        for target, value in updates.items():
            if target in self.state:
                self.state[target] = value

    def _loss(self, mine: torch.Tensor | None) -> float:
        """The step's loss, which the loss stage's lead rank made, on every rank."""
        loss = torch.zeros((), dtype=torch.float32) if mine is None else mine.float()
        dist.broadcast(loss, src=self.loss_rank)
        return float(loss)

    # --- checkpoints ------------------------------------------------------------------------

    def _dtensor(self, name: str):
        """This stage's whole tensor `name` as a DTensor replicated on the stage's devices."""
        from torch.distributed.tensor import DTensor, Replicate

        if self.device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            # the stage's devices only: DCP asks a DTensor where its shards are, no collective
            self.device_mesh = DeviceMesh("cpu", torch.tensor(self.stage_devices),
                                          _init_backend=False)
        t = self.state[name]
        return DTensor.from_local(t, self.device_mesh, (Replicate(),), run_check=False,
                                  shape=t.shape, stride=t.stride())

    def state_dict(self, step: int) -> dict:
        """The checkpoint's state dict (`graphpar.training.checkpoint`) with this stage's
        tensors: every rank names only what its stage holds, DCP joins them."""
        plan = self.plan
        model = {key: self._dtensor(name) for key, name in plan.model_keys.items()
                 if name in self.state}
        model.update({k: v.clone() for k, v in plan.constants.items()})
        optimizer = {
            "state": {p: {slot: self._dtensor(n) for slot, n in slots.items()}
                      for p, slots in plan.optimizer_keys.items()
                      if slots and all(n in self.state for n in slots.values())},
            "param_groups": [{**{k: v for k, v in plan.optimizer.items() if k != "kind"},
                              "params": list(plan.optimizer_keys)}]}
        return {"model": model, "optimizer": optimizer, "step": step,
                "data": {"seed": int(self.data.get("seed", 0)), "step": step}}

    # --- the job's command --------------------------------------------------------------------

    def train(self, start: int, stop: int, resume: str | None,
              checkpoint_dir: str | None, every: int | None) -> None:
        """The job's `train` command (`graphpar.training.loop`)."""
        train_in_job(self, self.folder.path, start, stop, resume, checkpoint_dir, every)


class StageTrainWorker(PipelineWorker, StageRanks):
    """Global rank `rank` of a pipelined training job: `runtime.pipeline.describe_job`'s
    folder with a ``train`` entry (the plan, the data, where the loss is, which updated state
    crosses stages)."""

    def __init__(self, jobdir: str | Path, rank: int, world: int) -> None:
        super().__init__(jobdir, rank, world)
        self.stage_devices = tuple(self.comm.mesh.device_ids)
        self._setup_training(self.tensors["state"], set(self.runner.needed))
        self.state_out = [(dst, n) for src, dst, n in self.transfers if src == self.stage]
        self.state_in = [(src, n) for src, dst, n in self.transfers if dst == self.stage]

    def step(self, index: int) -> float:
        """Step `index` (0-based) on this device: the batch in microbatches, the action list,
        the updates kept and shared; the step's loss (the mean over microbatches)."""
        runner = self.runner
        runner.next_step(self.state, self._batch(index, self.microbatches))
        self._step(runner)
        self._keep(runner.updates)
        self._share_updates()
        return self._loss(runner.mean_loss())

    def _share_updates(self) -> None:
        """Send what this stage updated and another stage reads; take what it reads from
        others (receives posted first, so no two stages wait on each other)."""
        tag = self.microbatches + STATE_TAG_OFFSET
        posted = {src: self._post([n for s, n in self.state_in if s == src], src, tag)
                  for src in dict.fromkeys(s for s, _ in self.state_in)}
        for dst in dict.fromkeys(d for d, _ in self.state_out):
            names = [n for d, n in self.state_out if d == dst]
            self._send(names, [self.state[n] for n in names], dst, tag)
        for take in posted.values():
            names, tensors = take()
            self.state.update(zip(names, tensors))
        self.comm.finish()


class TokenTrainWorker(TokenPipelineWorker, StageRanks):
    """Rank `rank` (stage `rank`, one process) of a token-pipelined training job:
    `runtime.token_pipeline.describe_token_job`'s folder with a ``train`` entry."""

    def __init__(self, jobdir: str | Path, rank: int, world: int) -> None:
        super().__init__(jobdir, rank, world)
        self.stage_devices = (rank,)
        stage = self.stage
        needed = set().union(*(r.needed for r in stage.runners), *(
            [stage.update_runner.needed] if stage.update_runner is not None else []))
        # the stage's programs read each slice's `input_ids` and `target` (`slice_inputs`)
        reads = {name for name, sliced in zip(self.job["names"], ("input_ids", "target"))
                 if sliced in needed}
        self._setup_training({k: v for k, v in self.tensors["state"].items() if k in needed},
                             reads)
        self.tensors = None  # every stage's state, read once: only its own is kept
        self.state_out = [(dst, n) for src, dst, n in self.transfers if src == rank]
        self.state_in = [(src, n) for src, dst, n in self.transfers if dst == rank]

    def step(self, index: int) -> float:
        """Step `index` (0-based) on this stage: the batch in microbatches cut into token
        slices, the action list, the updates kept and shared; the step's loss."""
        stage = self.stage
        micro = self._batch(index, stage.microbatches)
        stage.next_step(self.state, slice_inputs(micro, self.job["names"],
                                                 self.job["token_slices"]))
        self._step()
        self._keep(stage.updates)
        self._share_updates()
        return self._loss(stage.mean_loss())

    def _share_updates(self) -> None:
        """As `StageTrainWorker._share_updates`, a packed message per pair of stages."""
        from graphpar.ir.types import TensorType

        comm = self.comm
        tag = self.stage.microbatches * len(self.slices) + STATE_TAG_OFFSET
        posted = {}
        for src in dict.fromkeys(s for s, _ in self.state_in):
            names = [n for s, n in self.state_in if s == src]
            posted[src] = names, comm.post_packed(
                [TensorType.of(self.state[n]) for n in names], src, tag)
        for dst in dict.fromkeys(d for d, _ in self.state_out):
            comm.send_packed([self.state[n] for d, n in self.state_out if d == dst], dst, tag)
        for names, message in posted.values():
            self.state.update(zip(names, message.wait()))
        comm.finish()
