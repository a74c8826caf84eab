"""SPMD jobs: a device program on one process per rank over gloo on loopback, and its worker.

:class:`SpmdJob` is a job of the one job protocol (:mod:`graphpar.runtime.jobs`): it writes
each rank's program as IR text and the mesh to the job folder, then each run's inputs, and
calls its workers (:class:`SpmdWorker`) as often as asked. Every worker prepares its program
once (:class:`~graphpar.backends.interpreter.Interpreter` with a ``GlooCommunicator``) and runs
it on each run's inputs, replying with its outputs and byte records (the plan's definition and
the payloads counted at gloo). ``run_multiprocess`` is one job with one run.
:meth:`SpmdJob.time_steps` times repeated steps inside the workers, so that starting the
processes and moving tensors through the folder are not timed.

`torchrun --nproc-per-node N -m graphpar.runtime.launch JOBDIR` runs a job folder's first run
as well (:func:`graphpar.runtime.jobs.torchrun_main`): the worker reads only torchrun's
environment and the folder, and writes ``result<rank>.1.pt`` (or ``error<rank>.txt``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from graphpar.backends.interpreter import Interpreter
from graphpar.errors import BackendError
from graphpar.ir.spmd_ops import GROUP_OPS, node_axes
from graphpar.runtime.comm import CommRecord
from graphpar.runtime.gloo import GlooCommunicator
from graphpar.runtime.jobs import Job, JobWorker, mesh_entry, torchrun_main
from graphpar.runtime.overlap import defer_reduced, plan_buckets
from graphpar.runtime.program import (
    GraphArg,
    Inputs,
    MeshArg,
    SpmdResult,
    StepTimes,
    load_program,
)
from graphpar.runtime.timing import trimmed_mean
from graphpar.runtime.workers import free_port, torchrun_env

__all__ = ["SpmdJob", "SpmdWorker", "free_port", "main", "run_multiprocess", "torchrun_env"]


class SpmdJob:
    """A device program on one worker process per rank; :meth:`run` it on inputs, then
    :meth:`close` (or use it as a context manager). Arguments as ``run_multiprocess``."""

    def __init__(self, graph: GraphArg, mesh: MeshArg = None, timeout: float = 120.0, *,
                 deterministic: bool = True, bucket_bytes: int | None = None) -> None:
        graphs, self.mesh = load_program(graph, mesh)
        self.job = Job(self.mesh.size, "graphpar.runtime.launch:SpmdWorker", prefix="spmd",
                       timeout=timeout, name="SPMD")
        self.jobdir, self.group = self.job.path, self.job.group
        self.runs = 0
        try:
            entries: dict[int, dict] = {}  # one file per distinct graph
            for g in graphs:
                if id(g) not in entries:
                    entries[id(g)] = self.job.folder.write_graph(f"graph{len(entries)}.gpir", g,
                                                                 source=True)
            axes = sorted({node_axes(n) for g in graphs for n in g.nodes if n.op in GROUP_OPS})
            self.job.folder.describe({
                **mesh_entry(self.mesh), "graphs": [entries[id(g)] for g in graphs],
                "axes": [list(a) for a in axes], "timeout": timeout,
                "deterministic": deterministic, "bucket_bytes": bucket_bytes})
        except BaseException:
            self.close()
            raise

    def run(self, per_rank_inputs: Sequence[Inputs]) -> SpmdResult:
        """Every rank's outputs and byte records for these inputs (one set per rank)."""
        results = self.job.call("run", self.write_inputs(per_rank_inputs))
        return SpmdResult([r["outputs"] for r in results],
                          [[CommRecord.from_dict(d) for d in r["records"]] for r in results],
                          counted=True)

    def time_steps(self, per_rank_inputs: Sequence[Inputs], steps: int = 5, warmup: int = 2,
                   *, profile: bool = False) -> StepTimes:
        """Run the program `warmup` times, then `steps` timed times, on these inputs (the same
        ones every step; a training step's updates are not fed back, which changes no
        timing). The workers time each step themselves, all ranks starting it together.
        `profile`: also time every node (`StepTimes.node_seconds`)."""
        if steps < 1 or warmup < 0:
            raise BackendError(f"time_steps: steps={steps}, warmup={warmup}: give at least one "
                               "timed step and no negative warm-up")
        timings = self.job.call("time_steps", self.write_inputs(per_rank_inputs), steps, warmup,
                                profile)
        times = StepTimes([t["wall"] for t in timings], [t["cpu"] for t in timings], warmup)
        if profile:
            times.node_seconds = [t["nodes"] for t in timings]
        return times

    def write_inputs(self, per_rank_inputs: Sequence[Inputs]) -> int:
        """Write a run's inputs for every rank (``inputs<rank>.<run>.pt``); returns the run's
        number. The first run's, written before any worker starts, are what torchrun runs
        (module docstring)."""
        world = self.mesh.size
        if len(per_rank_inputs) != world:
            raise BackendError(f"{len(per_rank_inputs)} input sets given for a {world}-rank "
                               "mesh; give one per rank, in the mesh's row-major order")
        self.runs += 1
        self.job.save_each("inputs", [_plain(inputs) for inputs in per_rank_inputs], self.runs)
        return self.runs

    def close(self) -> None:
        """Stop the workers and remove the job directory."""
        self.job.close()

    def __enter__(self) -> SpmdJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plain(inputs: Inputs) -> Inputs:
    """A rank's inputs as a dict or a list (what a worker loads)."""
    return {k: inputs[k] for k in inputs.keys()} if hasattr(inputs, "keys") else list(inputs)


def run_multiprocess(graph: GraphArg, per_rank_inputs: Sequence[Inputs], mesh: MeshArg = None,
                     timeout: float = 120.0, *, deterministic: bool = True,
                     bucket_bytes: int | None = None) -> SpmdResult:
    """See `graphpar.runtime.spmd.run_spmd_multiprocess`."""
    with SpmdJob(graph, mesh, timeout, deterministic=deterministic,
                 bucket_bytes=bucket_bytes) as job:
        return job.run(per_rank_inputs)


# ------------------------------------------------------------------------- the worker

class SpmdWorker(JobWorker):
    """Rank ``rank`` of the job in ``jobdir``: its program prepared once over a
    ``GlooCommunicator`` (torch.distributed must be initialized)."""

    def __init__(self, jobdir: Path, rank: int, world: int) -> None:
        super().__init__(jobdir, rank, world)
        mesh = self.folder.mesh(world=world)
        graph = self.folder.read_graph(self.job["graphs"][rank])
        self.comm = GlooCommunicator(mesh, rank, [tuple(a) for a in self.job["axes"]],
                                     deterministic=self.job["deterministic"])
        bucket_bytes, buckets = self.job.get("bucket_bytes"), []
        if bucket_bytes is not None:  # as a training rank runs a step (byte records then
            defer_reduced(graph)      # name the nodes' positions in the reordered graph)
            buckets = plan_buckets(graph, bucket_bytes)
        self.interpreter = Interpreter(graph, self.comm, buckets=buckets)

    def run(self, number: int = 1) -> dict:
        """Run on ``inputs<rank>.<number>.pt``: the outputs and the byte records."""
        inputs = self.load_own("inputs", number)
        self.comm.records.clear()
        outputs = self.interpreter.run(inputs)
        self.comm.finish()
        return {"outputs": list(outputs), "records": [r.as_dict() for r in self.comm.records]}

    def time_steps(self, number: int, steps: int, warmup: int, profile: bool = False) -> dict:
        """Run on ``inputs<rank>.<number>.pt`` `warmup` + `steps` times, each after a barrier
        so that all ranks start it together: the timed steps' wall and CPU seconds (and with
        `profile`, each node's mean seconds over the timed steps, its slowest one dropped)."""
        inputs = self.load_own("inputs", number)
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
        result: dict = {"wall": wall, "cpu": cpu}
        if profile:
            result["nodes"] = {i: trimmed_mean(s) for i, s in nodes.items()}
        return result


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
    return torchrun_main(SpmdWorker, "run", 1, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
