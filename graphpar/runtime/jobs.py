"""The one job protocol: a job folder, a worker group that runs commands, and their replies.

Every launcher that runs ranks in processes of their own (SPMD jobs, CUDA listings, pipeline
stages, token-pipeline stages, calibration benches, tensor-parallel serving) does it this way:

1. The driver makes a :class:`Job`: a fresh job folder and a
   :class:`~graphpar.runtime.workers.WorkerGroup` on it. It writes into the folder what the
   workers read (:class:`JobFolder`): the job's description (``job.json``), programs as IR text
   (:meth:`JobFolder.write_graph`; an entry of the description names the file and the outputs'
   targets, which do not print), tensors (one file for all, or each rank its own:
   :meth:`Job.save_each`).
2. Each worker builds its handler with the launcher's factory, ``FACTORY(jobdir, rank,
   world)``: a :class:`JobWorker`, whose methods are the commands it runs (a launcher's own
   part), reading the folder.
3. :meth:`Job.call` runs ``handler.name(*args)`` on every worker (starting them on the first
   call) and returns what each returned, in rank order: the worker writes its reply to
   ``result<rank>.<call>.pt``, whole or not at all (:meth:`JobWorker.reply`).
   :meth:`Job.send` only sends a command: tensor-parallel serving's ranks meet in the
   collectives of the step instead.
4. :meth:`Job.close` stops the workers and removes the folder.

Under torchrun, the same worker answers one call (:func:`torchrun_main`): torchrun's agent
starts the processes and sets their environment, the worker reads only that and the folder.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from graphpar.errors import BackendError
from graphpar.ir.graph import Graph
from graphpar.ir.mesh import Mesh
from graphpar.runtime.workers import WorkerGroup, report_rank_error

__all__ = ["JOB_FILE", "Job", "JobFolder", "JobWorker", "mesh_entry", "own_storage",
           "rank_file", "torchrun_main"]

JOB_FILE = "job.json"


def rank_file(stem: str, rank: int, number: int | None = None, suffix: str = ".pt") -> str:
    """A rank's file in a job folder: ``<stem><rank>.<number><suffix>``, or without a number
    ``<stem><rank><suffix>``."""
    return f"{stem}{rank}{'' if number is None else f'.{number}'}{suffix}"


def mesh_entry(mesh: Mesh) -> dict[str, list[int]]:
    """A mesh as a job description holds it (:meth:`JobFolder.mesh` reads it back)."""
    return {"mesh": list(mesh.shape), "device_ids": list(mesh.device_ids)}


def own_storage(value: Any) -> Any:
    """`value` with each tensor view in it (in dicts, lists and tuples) replaced by a copy of
    its own: ``torch.save`` saves a view with its whole storage."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value._is_view() else value
    if isinstance(value, Mapping):
        return {k: own_storage(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(own_storage(v) for v in value)
    return value


class JobFolder:
    """A job's folder, as its driver writes it and its workers read it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    # --- the description --------------------------------------------------------------------

    def describe(self, description: Mapping[str, Any]) -> None:
        """Write the job's description (``job.json``)."""
        (self.path / JOB_FILE).write_text(json.dumps(description))
        self.__dict__.pop("description", None)

    @functools.cached_property
    def description(self) -> dict[str, Any]:
        """The job's description, as :meth:`describe` wrote it."""
        return json.loads((self.path / JOB_FILE).read_text())

    def mesh(self, entry: Mapping[str, Any] | None = None, world: int | None = None) -> Mesh:
        """The mesh `entry` (by default the description) holds (:func:`mesh_entry`); with
        `world`, it must have one device per process of the world."""
        entry = self.description if entry is None else entry
        mesh = Mesh(tuple(entry["mesh"]), tuple(entry["device_ids"]))
        if world is not None and world != mesh.size:
            raise BackendError(f"WORLD_SIZE={world} but the job's mesh {mesh} has {mesh.size} "
                               "devices")
        return mesh

    # --- files ------------------------------------------------------------------------------

    def write_text(self, name: str, text: str) -> None:
        (self.path / name).write_text(text)

    def read_text(self, name: str) -> str:
        return (self.path / name).read_text()

    def write_graph(self, name: str, graph: Graph, *, source: bool = False) -> dict[str, Any]:
        """Write `graph` as IR text (with its source lines if `source`) to file `name`; returns
        its entry for the description (the file and the outputs' targets, which do not
        print), what :meth:`read_graph` takes."""
        from graphpar.ir.printer import print_graph

        self.write_text(name, print_graph(graph, show_source=source, show_cost=False))
        return {"file": name, "targets": [o.target for o in graph.outputs]}

    def read_graph(self, entry: Mapping[str, Any]) -> Graph:
        """The graph :meth:`write_graph` wrote, its outputs' targets put back."""
        from graphpar.ir.parser import parse

        graph = parse(self.read_text(entry["file"]), entry["file"])
        for out, target in zip(graph.outputs, entry["targets"]):
            out.target = target
        return graph

    def save(self, name: str, value: Any) -> None:
        """Save tensors (in dicts, lists and tuples) to file `name`, each view as its own
        copy."""
        torch.save(own_storage(value), self.path / name)

    def save_whole(self, name: str, value: Any) -> None:
        """:meth:`save`, the file appearing whole or not at all (a reader waits for it to
        exist)."""
        path = self.path / name
        torch.save(own_storage(value), path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)

    def load(self, name: str) -> Any:
        return torch.load(self.path / name, weights_only=True)


class Job:
    """The driver's half: a fresh job folder (:attr:`folder`) and a worker group on it.

    Args:
        world: the number of ranks in the process group.
        worker: ``"module:factory"``; each worker calls ``factory(jobdir, rank, world)``.
        prefix: the folder's name starts ``graphpar-<prefix>-``.
        ranks: the ranks that are worker processes (default: all); the others are this
            process's to play.
        timeout: seconds any wait (a collective, the start, a command) may take.
        name: what the ranks are called in messages ("SPMD", "pipeline").
    """

    def __init__(self, world: int, worker: str, *, prefix: str,
                 ranks: Sequence[int] | None = None, timeout: float = 120.0,
                 name: str = "worker") -> None:
        self.folder = JobFolder(tempfile.mkdtemp(prefix=f"graphpar-{prefix}-"))
        self.group = WorkerGroup(world, worker, self.folder.path, ranks=ranks,
                                 timeout=timeout, name=name)
        self.calls = 0

    @property
    def path(self) -> Path:
        return self.folder.path

    def save_each(self, stem: str, values: Sequence[Any] | Mapping[int, Any],
                  number: int | None = None) -> None:
        """Save each rank's value (`values[rank]`) to its own file (:func:`rank_file`), which
        its worker reads with :meth:`JobWorker.load_own`."""
        items = values.items() if isinstance(values, Mapping) else enumerate(values)
        for rank, value in items:
            self.folder.save(rank_file(stem, rank, number), value)

    def start(self, *, wait: bool = False) -> None:
        """Start the workers unless they are started; with `wait`, wait until every one has
        reached the rendezvous (`WorkerGroup.wait_started`)."""
        if not self.group.processes:
            self.group.start()
        if wait:
            self.group.wait_started()

    def call(self, command: str, *args: Any) -> list[Any]:
        """Run ``handler.command(*args)`` on every worker (starting them on the first call)
        and return what each returned, in rank order."""
        self.start()
        self.calls += 1
        self.group.wait(self.group.send("reply", self.calls, command, *args))
        return [self.folder.load(rank_file("result", rank, self.calls))
                for rank in self.group.ranks]

    def send(self, command: str, *args: Any) -> int:
        """Send ``handler.command(*args)`` to every worker without waiting for it; returns its
        number (`WorkerGroup.wait`)."""
        return self.group.send(command, *args)

    def close(self, kill: bool = False) -> None:
        """Stop the workers (with `kill`, at once) and remove the folder."""
        self.group.stop(kill=kill)
        shutil.rmtree(self.folder.path, ignore_errors=True)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JobWorker:
    """The worker's half: rank `rank` of `world` in the job in folder `jobdir`, its
    description read (:attr:`job`). A launcher's worker subclasses it: its methods are the
    commands, and what one returns is its reply to :meth:`Job.call`."""

    def __init__(self, jobdir: str | Path, rank: int, world: int) -> None:
        self.folder = JobFolder(jobdir)
        self.rank, self.world = rank, world
        self.job = self.folder.description

    def reply(self, number: int, command: str, *args: Any) -> None:
        """Run call `number`, ``self.command(*args)``; write what it returns to
        ``result<rank>.<number>.pt``."""
        self.folder.save_whole(rank_file("result", self.rank, number),
                               getattr(self, command)(*args))

    def load_own(self, stem: str, number: int | None = None) -> Any:
        """This rank's file that :meth:`Job.save_each` saved."""
        return self.folder.load(rank_file(stem, self.rank, number))


def torchrun_main(worker: Callable[[Path, int, int], JobWorker], command: str, *args: Any,
                  argv: Sequence[str] | None = None) -> int:
    """Be rank $RANK of $WORLD_SIZE under torchrun, in the job whose folder is argv[0]: join
    the process group torchrun's environment names (gloo, the description's ``timeout``),
    build the worker and answer call 1, ``command(*args)`` (``result<rank>.1.pt``; a failure
    goes to ``error<rank>.txt``). Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    jobdir = Path(argv[0]) if argv else Path(".")
    try:
        timeout = float(JobFolder(jobdir).description.get("timeout", 120.0))
        torch.distributed.init_process_group("gloo", init_method="env://",
                                             timeout=timedelta(seconds=timeout))
        worker(jobdir, rank, int(os.environ["WORLD_SIZE"])).reply(1, command, *args)
        return 0
    except BaseException as exc:  # report everything (before peers notice), exit non-zero
        return report_rank_error(jobdir, rank, exc)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
