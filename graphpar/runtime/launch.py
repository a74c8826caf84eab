"""One process per rank over gloo on loopback: SPMD jobs on a worker group, and their worker.

:class:`SpmdJob` writes a job directory (each rank's program as IR text, the mesh, then each
run's inputs), starts one worker per rank (:class:`graphpar.runtime.workers.WorkerGroup`), and
runs the program on the ranks as often as asked: every worker prepares its program once
(:class:`~graphpar.backends.interpreter.Interpreter` with a ``GlooCommunicator``) and runs it
on each run's inputs, writing its outputs and byte records (the plan's definition and the
payloads counted at gloo) back to the directory.
``run_multiprocess`` is one job with one run. :meth:`SpmdJob.time_steps` times repeated steps
inside the workers, so that starting the processes and moving tensors through the directory
are not timed.

`torchrun --nproc-per-node N -m graphpar.runtime.launch JOBDIR` runs a job directory's first
run as well: the worker reads only torchrun's environment and the directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch

from graphpar.backends.interpreter import Interpreter
from graphpar.errors import BackendError
from graphpar.ir.mesh import Mesh
from graphpar.ir.printer import print_graph
from graphpar.ir.spmd_ops import GROUP_OPS, node_axes
from graphpar.runtime.comm import CommRecord
from graphpar.runtime.gloo import GlooCommunicator
from graphpar.runtime.program import (
    GraphArg,
    Inputs,
    MeshArg,
    SpmdResult,
    StepTimes,
    load_program,
)
from graphpar.runtime.timing import trimmed_mean
from graphpar.runtime.workers import WorkerGroup, free_port, report_rank_error, torchrun_env

__all__ = ["SpmdJob", "SpmdWorker", "free_port", "main", "run_multiprocess", "torchrun_env"]


class SpmdJob:
    """A device program on one worker process per rank; :meth:`run` it on inputs, then
    :meth:`close` (or use it as a context manager). Arguments as ``run_multiprocess``."""

    def __init__(self, graph: GraphArg, mesh: MeshArg = None, timeout: float = 120.0, *,
                 deterministic: bool = True) -> None:
        graphs, self.mesh = load_program(graph, mesh)
        self.jobdir = Path(tempfile.mkdtemp(prefix="graphpar-spmd-"))
        self.runs = 0
        self.group = WorkerGroup(self.mesh.size, "graphpar.runtime.launch:SpmdWorker",
                                 self.jobdir, timeout=timeout, name="SPMD")
        try:
            texts: dict[int, str] = {}
            graph_file = []
            for g in graphs:
                texts.setdefault(id(g), print_graph(g, show_source=True, show_cost=False))
                graph_file.append(f"graph{list(texts).index(id(g))}.gpir")
            for i, text in enumerate(texts.values()):
                (self.jobdir / f"graph{i}.gpir").write_text(text)
            axes = sorted({node_axes(n) for g in graphs for n in g.nodes if n.op in GROUP_OPS})
            job = {"mesh": list(self.mesh.shape), "device_ids": list(self.mesh.device_ids),
                   "graphs": graph_file, "axes": [list(a) for a in axes], "timeout": timeout,
                   "deterministic": deterministic}
            (self.jobdir / "job.json").write_text(json.dumps(job))
        except BaseException:
            self.close()
            raise

    def run(self, per_rank_inputs: Sequence[Inputs]) -> SpmdResult:
        """Every rank's outputs and byte records for these inputs (one set per rank)."""
        world = self._send_inputs(per_rank_inputs)
        self.group.wait(self.group.send("run", self.runs))
        outputs, records = [], []
        for rank in range(world):
            data = torch.load(self.jobdir / f"result{rank}.{self.runs}.pt", weights_only=True)
            outputs.append(data["outputs"])
            records.append([CommRecord(**{**r, "axes": tuple(r["axes"])})
                            for r in data["records"]])
        return SpmdResult(outputs, records, counted=True)

    def time_steps(self, per_rank_inputs: Sequence[Inputs], steps: int = 5, warmup: int = 2,
                   *, profile: bool = False) -> StepTimes:
        """Run the program `warmup` times, then `steps` timed times, on these inputs (the same
        ones every step; a training step's updates are not fed back, which changes no
        timing). The workers time each step themselves, all ranks starting it together.
        `profile`: also time every node (`StepTimes.node_seconds`)."""
        if steps < 1 or warmup < 0:
            raise BackendError(f"time_steps: steps={steps}, warmup={warmup}: give at least one "
                               "timed step and no negative warm-up")
        world = self._send_inputs(per_rank_inputs)
        self.group.wait(self.group.send("time_steps", self.runs, steps, warmup, profile))
        timings = [json.loads((self.jobdir / f"timing{rank}.{self.runs}.json").read_text())
                   for rank in range(world)]
        times = StepTimes([t["wall"] for t in timings], [t["cpu"] for t in timings], warmup)
        if profile:
            times.node_seconds = [{int(i): s for i, s in t["nodes"].items()} for t in timings]
        return times

    def _send_inputs(self, per_rank_inputs: Sequence[Inputs]) -> int:
        """Write this run's inputs for every rank (starting the workers on the first run);
        returns the world size."""
        world = self.mesh.size
        if len(per_rank_inputs) != world:
            raise BackendError(f"{len(per_rank_inputs)} input sets given for a {world}-rank "
                               "mesh; give one per rank, in the mesh's row-major order")
        if not self.group.processes:
            self.group.start()  # on the first run, once its inputs are known to fit
        self.runs += 1
        for rank, inputs in enumerate(per_rank_inputs):
            torch.save(_own_storage(inputs), self.jobdir / f"inputs{rank}.{self.runs}.pt")
        return world

    def close(self) -> None:
        """Stop the workers and remove the job directory."""
        self.group.stop()
        shutil.rmtree(self.jobdir, ignore_errors=True)

    def __enter__(self) -> SpmdJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _own_storage(inputs: Inputs) -> Inputs:
    """Views are saved with their whole storage: save their own copy instead."""
    def own(t):
        return t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t
    if hasattr(inputs, "keys"):
        return {k: own(inputs[k]) for k in inputs.keys()}
    return [own(t) for t in inputs]


def run_multiprocess(graph: GraphArg, per_rank_inputs: Sequence[Inputs], mesh: MeshArg = None,
                     timeout: float = 120.0, *, deterministic: bool = True) -> SpmdResult:
    """See `graphpar.runtime.spmd.run_spmd_multiprocess`."""
    with SpmdJob(graph, mesh, timeout, deterministic=deterministic) as job:
        return job.run(per_rank_inputs)


# ------------------------------------------------------------------------- the worker

def read_job(jobdir: Path, world: int) -> tuple[dict, Mesh]:
    """A worker's view of its job: `job.json` and the mesh it declares, which must have one
    device per process of the world."""
    job = json.loads((Path(jobdir) / "job.json").read_text())
    mesh = Mesh(tuple(job["mesh"]), tuple(job["device_ids"]))
    if world != mesh.size:
        raise BackendError(f"WORLD_SIZE={world} but the job's mesh {mesh} has {mesh.size} "
                           "devices")
    return job, mesh


def write_result(path: Path, payload: dict) -> None:
    """Save a rank's result whole or not at all: the parent reads it once it exists."""
    torch.save(payload, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


class SpmdWorker:
    """Rank ``rank`` of the job in ``jobdir``: its program prepared once over a
    ``GlooCommunicator`` (torch.distributed must be initialized)."""

    def __init__(self, jobdir: Path, rank: int, world: int) -> None:
        from graphpar.ir.parser import parse

        self.jobdir, self.rank = Path(jobdir), rank
        job, mesh = read_job(self.jobdir, world)
        graph_name = job["graphs"][rank]
        graph = parse((self.jobdir / graph_name).read_text(), graph_name)
        self.comm = GlooCommunicator(mesh, rank, [tuple(a) for a in job["axes"]],
                                     deterministic=job["deterministic"])
        self.interpreter = Interpreter(graph, self.comm)

    def run(self, number: int = 1) -> None:
        """Run on ``inputs<rank>.<number>.pt``; write ``result<rank>.<number>.pt``."""
        inputs = torch.load(self.jobdir / f"inputs{self.rank}.{number}.pt", weights_only=True)
        self.comm.records.clear()
        outputs = self.interpreter.run(inputs)
        self.comm.finish()
        write_result(self.jobdir / f"result{self.rank}.{number}.pt",
                     {"outputs": list(outputs),
                      "records": [r.as_dict() for r in self.comm.records]})


    def time_steps(self, number: int, steps: int, warmup: int, profile: bool = False) -> None:
        """Run on ``inputs<rank>.<number>.pt`` `warmup` + `steps` times, each after a barrier
        so that all ranks start it together; write the timed steps' wall and CPU seconds (and
        with `profile`, each node's mean seconds over the timed steps, its slowest one
        dropped) to
        ``timing<rank>.<number>.json``."""
        inputs = torch.load(self.jobdir / f"inputs{self.rank}.{number}.pt", weights_only=True)
        nodes: dict[int, list[float]] = {}
        interpreter = _profiled(self.interpreter, nodes) if profile else self.interpreter
        wall, cpu = [], []
        for i in range(warmup + steps):
            self.comm.barrier()
            self.comm.records.clear()
            if i == warmup:
                nodes.clear()
            start, start_cpu = time.perf_counter(), time.process_time()
            interpreter.run(inputs)
            self.comm.finish()
            if i >= warmup:
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
        result = {"wall": wall, "cpu": cpu}
        if profile:
            result["nodes"] = {str(i): trimmed_mean(s) for i, s in nodes.items()}
        path = self.jobdir / f"timing{self.rank}.{number}.json"
        path.with_suffix(".tmp").write_text(json.dumps(result))
        os.replace(path.with_suffix(".tmp"), path)


def _profiled(interpreter: Interpreter, seconds: dict[int, list[float]]) -> Interpreter:
    """A copy of `interpreter` that appends each node's wall seconds per run to
    `seconds[index]` (collectives included: their time is the wait for the group as well as
    the transfer)."""
    import copy

    def timed(index, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds.setdefault(index, []).append(time.perf_counter() - start)
        return run

    profiled = copy.copy(interpreter)
    profiled.plan = [(i, node, fn if fn is None else timed(i, fn), *rest)
                     for i, node, fn, *rest in interpreter.plan]
    communicate = interpreter.communicate
    profiled.communicate = lambda index, node, args: timed(index, communicate)(index, node,
                                                                               args)
    return profiled


def main(argv: Sequence[str] | None = None) -> int:
    """Under torchrun: run rank $RANK of the job in directory argv[0] on its first run's
    inputs; write result<rank>.1.pt or error<rank>.txt. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    jobdir = Path(argv[0]) if argv else Path(".")
    try:
        job = json.loads((jobdir / "job.json").read_text())
        torch.distributed.init_process_group(
            "gloo", init_method="env://", timeout=timedelta(seconds=float(job["timeout"])))
        SpmdWorker(jobdir, rank, int(os.environ["WORLD_SIZE"])).run(1)
        return 0
    except BaseException as exc:  # report everything (before peers notice), exit non-zero
        return report_rank_error(jobdir, rank, exc)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
