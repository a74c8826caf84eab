"""One device of a pipelined training run: its stage's part of the state, step after step.

`StageTrainWorker` is the pipeline runtime's worker (`graphpar.runtime.pipeline.PipelineWorker`:
its stage's programs, its action list, tiles over gloo) kept for the whole run. Each step it
reads the step's batch, cuts it into microbatches, runs its action list on its stage's runner
(`StageRunner.next_step`: the interpreters are kept), keeps the updates, and sends the updated
tensors another stage reads (a tied embedding, Adam's step count) to it. The loss, made on the
last stage, is broadcast so rank 0 reports it.

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
from graphpar.training.plan import TrainPlan
from graphpar.training.rank import RankSteps, batch_source, plan_from_description, train_in_job

STATE_TAG_OFFSET = 1  # tag of the updated-state message: after the microbatches' and gradients'


def state_transfers(pipe) -> list[tuple[int, int, str]]:
    """(from stage, to stage, name) for each state tensor a stage updates that another stage's
    programs read: after every step it is sent there, or that stage would read a stale copy."""
    from graphpar.ir.graph import OutputRole

    updated: dict[str, int] = {}
    for program in pipe.programs.stages:
        for graph in program.graphs():
            for out in graph.outputs:
                if out.role is OutputRole.UPDATE:
                    updated[out.target] = program.stage
    transfers = set()
    for program in pipe.programs.stages:
        read = {v.name for g in program.graphs() for v in g.inputs}
        for name in read:
            if name in updated and updated[name] != program.stage:
                transfers.add((updated[name], program.stage, name))
    return sorted(transfers)


def loss_stage(pipe) -> int:
    """The stage whose forward makes the loss."""
    from graphpar.ir.graph import OutputRole

    for program in pipe.programs.stages:
        for graph in program.graphs():
            if any(out.role is OutputRole.LOSS for out in graph.outputs):
                return program.stage
    return len(pipe.programs.stages) - 1


class StageTrainWorker(PipelineWorker, RankSteps):
    """Global rank `rank` of a pipelined training job (`runtime.pipeline.describe_job`'s folder
    with a ``train`` entry: the plan, the data, the user inputs' names, where the loss is and
    which updated state crosses stages)."""

    def __init__(self, jobdir: str | Path, rank: int, world: int) -> None:
        super().__init__(jobdir, rank, world)
        train = self.job["train"]
        self.plan: TrainPlan = plan_from_description(train["plan"], "",
                                                     self.folder.load("constants.pt"))
        self.data = train["data"]
        self.batches = batch_source(self.data, self.plan)
        self.names = list(self.plan.inputs)
        self.loss_rank = train["loss_rank"]
        self.state = dict(self.tensors["state"])
        transfers = [tuple(t) for t in train["state_transfers"]]
        self.state_out = [(dst, n) for src, dst, n in transfers if src == self.stage]
        self.state_in = [(src, n) for src, dst, n in transfers if dst == self.stage]
        self.device_mesh = None

    # --- steps ------------------------------------------------------------------------------

    def step(self, index: int) -> float:
        """Step `index` (0-based) on this device: the batch in microbatches, the action list,
        the updates kept and shared; the step's loss (the mean over microbatches)."""
        inputs, targets = self.batches(index)
        micro = split_microbatches(dict(zip(self.names, (*inputs, *targets))),
                                   self.microbatches)
        runner = self.runner
        runner.next_step(self.state, micro)
        self._step(runner)
        for target, value in runner.updates.items():
            if target in self.state:
                self.state[target] = value
        self._share_updates()
        loss = runner.mean_loss()
        loss = torch.zeros((), dtype=torch.float32) if loss is None else loss.float()
        dist.broadcast(loss, src=self.loss_rank)
        return float(loss)

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

    # --- checkpoints ------------------------------------------------------------------------

    def _dtensor(self, name: str):
        """This stage's whole tensor `name` as a DTensor replicated on the stage's sub-mesh."""
        from torch.distributed.tensor import DTensor, Replicate

        if self.device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            # the stage's devices only: DCP asks a DTensor where its shards are, no collective
            self.device_mesh = DeviceMesh("cpu", torch.tensor(self.comm.mesh.device_ids),
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
        train_in_job(self, self.folder.path, start, stop, resume, checkpoint_dir,
                     every)

