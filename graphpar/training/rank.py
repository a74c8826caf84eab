"""One rank of a training run: its part of the step's state, run step after step on data.

`TrainRank` holds its shards of the parameters and optimizer state between steps (nothing
goes back to a driver), reads each step's batch itself (only the rows its layout holds), runs
the device program with the one `Interpreter` over a `GlooCommunicator`, and saves and loads
DCP checkpoints (`graphpar.training.checkpoint`). The same class runs a rank whichever way it
was launched: a worker of `graphpar train`'s own job (`TrainWorker`, the one job protocol), or
a process torchrun started (`graphpar.training.loop`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from graphpar.backends.interpreter import Interpreter
from graphpar.errors import CheckpointError
from graphpar.ir.parser import parse
from graphpar.runtime.gloo import GlooCommunicator
from graphpar.runtime.jobs import JobWorker
from graphpar.runtime.overlap import DEFAULT_BUCKET_BYTES, defer_reduced, plan_buckets
from graphpar.runtime.spmd import shard_tensor, unshard
from graphpar.training import checkpoint
from graphpar.training.data import ModelFileBatches, TokenWindows
from graphpar.training.plan import Tensor, TrainPlan

PROGRESS = "progress.jsonl"  # rank 0's per-step records in a job folder, for the driver


def batch_source(data: dict, plan: TrainPlan):
    """The batches `data` names: ``{"kind": "batch", "path": model file}`` (its batch(step))
    or ``{"kind": "tokens", "path": token file, "seed": S}``."""
    inputs = [(tuple(t.shape), t.torch_dtype) for t in plan.inputs.values()]
    if data["kind"] == "batch":
        from graphpar.compiler.model_file import model_function

        n = data["num_inputs"]
        return ModelFileBatches(model_function(data["path"], "batch"), data["path"],
                                inputs[:n], inputs[n:])
    (batch, seq), _ = inputs[0]
    return TokenWindows(data["path"], batch, seq, data["seed"])


class RankSteps:
    """What every kind of training rank shares: the step loop with its reports and
    checkpoints, DCP save and load. A rank provides `plan`, `rank`, `state` (its tensors by
    the step's names), `step(index) -> loss` and `state_dict(step)` (the checkpoint's layout,
    its tensors over `state`'s)."""

    plan: TrainPlan
    rank: int
    state: dict[str, torch.Tensor]

    def step(self, index: int) -> float:
        raise NotImplementedError

    def state_dict(self, step: int) -> dict:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for this rank's device to finish what was queued (a GPU's kernels run behind
        the Python that launched them), so that the clock measures the step."""

    def run_steps(self, start: int, stop: int, checkpoint_dir: str | None = None,
                  every: int | None = None,
                  on_step: Callable[[dict], None] | None = None) -> list[float]:
        """Steps `start`..`stop`-1; after each update (numbered start+1..stop) report it, and
        save a checkpoint every `every` updates and after the last."""
        losses = []
        for index in range(start, stop):
            self.synchronize()
            began = time.perf_counter()
            loss = self.step(index)
            self.synchronize()
            seconds = time.perf_counter() - began
            losses.append(loss)
            done = index + 1
            if on_step is not None:
                on_step({"step": done, "loss": loss, "seconds": seconds,
                         "tokens_per_second": self.plan.tokens_per_step / seconds,
                         "estimated_seconds": self.plan.estimated_seconds,
                         "plan": self.plan.plan_name})
            if checkpoint_dir and ((every and done % every == 0) or done == stop):
                self.save(Path(checkpoint_dir), done)
        return losses

    def save(self, directory: Path, step: int) -> None:
        """Write checkpoint `step` (every rank its shards); rank 0 publishes it when all are
        in."""
        import torch.distributed.checkpoint as dcp

        partial = checkpoint.partial_path(directory, step)
        if self.rank == 0:
            if partial.exists():
                import shutil

                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        dist.barrier()
        dcp.save(self.state_dict(step), storage_writer=dcp.FileSystemWriter(str(partial)))
        dist.barrier()
        if self.rank == 0:
            checkpoint.publish(directory, step)
        dist.barrier()

    def load(self, path: Path) -> int:
        """Load the checkpoint at `path` into this rank's state (DCP reshards it to this
        plan's layouts); returns its step."""
        import torch.distributed.checkpoint as dcp

        state = self.state_dict(0)
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as exc:  # DCP's own errors: a shard file missing or cut short
            raise CheckpointError(f"{path}: could not be loaded ({type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[-1] if str(exc) else ''}); "
                                  "delete it to resume from an older one") from None
        for key, name in self.plan.model_keys.items():
            if key in state["model"]:
                self.state[name] = _local(state["model"][key])
        for param, slots in self.plan.optimizer_keys.items():
            for slot, name in slots.items():
                if slot in state["optimizer"]["state"].get(param, {}):
                    self.state[name] = _local(state["optimizer"]["state"][param][slot])
        return int(state["step"])


def _local(t: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a checkpoint's tensor: a DTensor's local shard, or the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class TrainRank(RankSteps):
    """Rank `rank` of `plan`'s mesh; torch.distributed must be initialized with one process
    per device of the mesh."""

    def __init__(self, plan: TrainPlan, rank: int, data: dict,
                 state: dict[str, torch.Tensor],
                 bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                 device: str = "cpu") -> None:
        """`bucket_bytes`: the gradient all-reduces go in buckets of about this many bytes,
        each launched as soon as its gradients are computed and waited for where the update
        first reads one, the updates deferred until after the backward
        (`graphpar.runtime.overlap`); None runs the program as it is.

        `device`: "cpu", or a GPU ("cuda:N"): the state and batches live there, the step's
        collectives go over NCCL, and the program runs under that device as torch's default
        (its `full`/`arange` nodes and the communicator's buffers are made there)."""
        self.plan, self.rank, self.data = plan, rank, data
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        if self.on_gpu:
            torch.cuda.set_device(self.device)
        graph = parse(plan.program, f"{plan.name}.gpir")
        for out, target in zip(graph.outputs, plan.targets):
            out.target = target
        self.mesh = graph.mesh
        self.comm = GlooCommunicator(self.mesh, rank, plan.axes, deterministic=False,
                                     backend="nccl" if self.on_gpu else "gloo",
                                     tensor_device=self.device if self.on_gpu else None)
        buckets = []
        if bucket_bytes is not None:
            defer_reduced(graph)
            buckets = plan_buckets(graph, bucket_bytes)
        self.interpreter = Interpreter(graph, self.comm, buckets=buckets)
        self.outputs = graph.outputs
        self.state = ({k: v.to(self.device) for k, v in state.items()} if self.on_gpu
                      else dict(state))
        self.batches = batch_source(data, plan)
        self.layouts = {name: t.placements() for name, t in plan.inputs.items()}
        # the batch rows this rank holds of any input (a data-parallel plan: its share)
        held = [self.layouts[n].local_slices(t.shape, self.mesh, rank)[0]
                for n, t in plan.inputs.items() if t.shape]
        self.rows = slice(min(s.start for s in held), max(s.stop for s in held))
        from torch.distributed.device_mesh import init_device_mesh

        self.device_mesh = init_device_mesh(self.device.type, tuple(self.mesh.shape))

    def synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    # --- steps ------------------------------------------------------------------------------

    def step(self, index: int) -> float:
        """Step `index` (0-based): its batch, the program, the updates kept; the loss."""
        inputs, targets = self.batches(index, self.rows)
        self.comm.records.clear()  # a step's byte records only, not a whole run's
        local = dict(self.state)
        for (name, layout), tensor in zip(self.layouts.items(), (*inputs, *targets)):
            local[name] = shard_tensor(tensor, layout, self.mesh, self.rank)
            if self.on_gpu:
                local[name] = local[name].to(self.device)
        with torch.device(self.device) if self.on_gpu else contextlib.nullcontext():
            outputs = self.interpreter.run(local)
        self.comm.finish()
        for out, value in zip(self.outputs, outputs):
            if out.target is not None and out.role.value == "update":
                self.state[out.target] = value
        return self.loss(outputs[self.plan.loss_index])

    def loss(self, local: torch.Tensor) -> float:
        layout = self.outputs[self.plan.loss_index].value.layout
        if layout.is_replicated:
            return float(local)
        local = local.cpu()  # over the world's gloo group, whatever the step's device
        gathered = [torch.empty_like(local) for _ in range(self.mesh.size)]
        dist.all_gather(gathered, local.contiguous())
        return float(unshard(gathered, layout, self.mesh))

    # --- checkpoints ------------------------------------------------------------------------

    def _dtensor(self, name: str):
        from torch.distributed.tensor import DTensor

        t: Tensor = self.plan.state[name]
        layout = t.placements()
        if layout.is_partial:
            raise CheckpointError(f"state {name!r} is laid out {layout} (a partial sum) in this "
                                  "plan; checkpoints hold only sharded or replicated state")
        shape = torch.Size(t.shape)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(self.state[name], self.device_mesh, layout.to_torch(),
                                  run_check=False, shape=shape, stride=stride)

    def state_dict(self, step: int) -> dict:
        """The DCP state dict (module docstring of `graphpar.training.checkpoint`)."""
        plan = self.plan
        model = {key: self._dtensor(name) for key, name in plan.model_keys.items()}
        model.update({k: v.clone() for k, v in plan.constants.items()})
        optimizer = {
            "state": {p: {slot: self._dtensor(n) for slot, n in slots.items()}
                      for p, slots in plan.optimizer_keys.items() if slots},
            "param_groups": [{**{k: v for k, v in plan.optimizer.items() if k != "kind"},
                              "params": list(plan.optimizer_keys)}]}
        return {"model": model, "optimizer": optimizer, "step": step,
                "data": {"seed": int(self.data.get("seed", 0)), "step": step}}


class TrainWorker(JobWorker):
    """A rank of `graphpar train`'s own job: the plan, data and this rank's starting state
    from the job folder (`graphpar.training.loop.run_alone` writes them)."""

    def __init__(self, jobdir: str | Path, rank: int, world: int) -> None:
        super().__init__(jobdir, rank, world)
        plan = plan_from_description(self.job["plan"], self.folder.read_text("step.gpir"),
                                     self.folder.load("constants.pt"))
        device = self.job.get("device", "cpu")  # alone, every rank is on this machine
        self.trainer = TrainRank(plan, rank, self.job["data"], self.load_own("state"),
                                 device=f"cuda:{rank}" if device == "cuda" else "cpu")

    def train(self, start: int, stop: int, resume: str | None, checkpoint_dir: str | None,
              every: int | None) -> None:
        train_in_job(self.trainer, self.folder.path, start, stop, resume, checkpoint_dir, every)


def train_in_job(trainer: RankSteps, folder: Path, start: int, stop: int, resume: str | None,
                 checkpoint_dir: str | None, every: int | None) -> None:
    """A job's `train` command on one rank: resume, train, rank 0 appending each step's
    record to the job folder's progress file for the driver."""
    if resume:
        trainer.load(Path(resume))
    progress = None
    if trainer.rank == 0:
        progress = open(folder / PROGRESS, "a", encoding="utf-8")  # noqa: SIM115
    try:
        def report(record: dict) -> None:
            progress.write(json.dumps(record) + "\n")  # type: ignore[union-attr]
            progress.flush()  # type: ignore[union-attr]
        trainer.run_steps(start, stop, checkpoint_dir, every,
                          report if progress is not None else None)
    finally:
        if progress is not None:
            progress.close()


def plan_description(plan: TrainPlan) -> dict:
    """The plan as JSON for a job's description, less its program text and constants."""
    entry = asdict(plan)
    entry.pop("program")
    entry.pop("constants")
    return entry


def plan_from_description(entry: dict, program: str, constants: dict) -> TrainPlan:
    entry = dict(entry)
    entry["inputs"] = {k: Tensor(tuple(v["shape"]), v["dtype"], v["layout"])
                       for k, v in entry["inputs"].items()}
    entry["state"] = {k: Tensor(tuple(v["shape"]), v["dtype"], v["layout"])
                      for k, v in entry["state"].items()}
    entry["mesh_shape"] = tuple(entry["mesh_shape"])
    entry["axes"] = [tuple(a) for a in entry["axes"]]
    return TrainPlan(**entry, program=program, constants=constants)
