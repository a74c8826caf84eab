"""Run CUDA listings on CPU ranks: one listing per rank, NCCL calls over gloo.

One rank with no communication runs in this process. Several ranks run as a worker group
(`graphpar.runtime.workers.WorkerGroup`), one process per rank: each worker reads its
listing's text from the job directory, makes a `GlooCommunicator` for the mesh-axis groups
the listings name, and runs the listing call for call with
`graphpar.backends.cuda.cpu_executor.CpuListingExecutor`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from graphpar.backends.cuda.cpu_executor import CpuListingExecutor
from graphpar.errors import BackendError
from graphpar.ir.cuda_listing import Listing, parse_listing, print_listing
from graphpar.ir.mesh import Mesh
from graphpar.runtime.comm import CommRecord
from graphpar.runtime.program import Inputs, SpmdResult

__all__ = ["ListingResult", "ListingWorker", "communicator_axes", "run_listings"]


@dataclass
class ListingResult:
    """Every rank's outputs (`outputs[rank][i]`), the arena bytes each rank wrote up to
    (measured) and what each rank sent (`outputs.records`; `outputs.bytes_counted`: the
    payloads handed to gloo, None for one rank in this process)."""

    outputs: SpmdResult
    peak_arena_bytes: list[int]

    @property
    def records(self) -> list[list[CommRecord]]:
        return self.outputs.records


def communicator_axes(listings: Sequence[Listing]) -> list[tuple[int, ...]]:
    """The mesh-axis groups the listings' NCCL calls use (`comm=axes0_1` -> (0, 1))."""
    names = {c["comm"] for listing in listings for c in listing.calls
             if c.kind.startswith("nccl.") and str(c.get("comm", "")).startswith("axes")}
    return sorted(tuple(int(a) for a in name[4:].split("_")) for name in names)


def _communicates(listings: Sequence[Listing]) -> bool:
    return any(c.kind.startswith("nccl.") for listing in listings for c in listing.calls)


def run_listings(listings: Sequence[Listing], per_rank_inputs: Sequence[Inputs], mesh: Mesh,
                 *, poison: bool = False, timeout: float = 120.0) -> ListingResult:
    """Run listing r on rank r of `mesh` with its inputs; `poison`: overwrite each buffer
    with NaN bytes after its last use (see CpuListingExecutor)."""
    if len(listings) != mesh.size or len(per_rank_inputs) != mesh.size:
        raise BackendError(f"{len(listings)} listings and {len(per_rank_inputs)} input sets "
                           f"for mesh {mesh} ({mesh.size} devices): give one of each per rank")
    if mesh.size == 1 and not _communicates(listings):
        executor = CpuListingExecutor(listings[0], poison=poison)
        outputs = executor.run(per_rank_inputs[0])
        return ListingResult(SpmdResult([outputs], [[]]), [executor.peak_arena_bytes])
    from graphpar.runtime.workers import WorkerGroup

    jobdir = Path(tempfile.mkdtemp(prefix="graphpar-cuda-"))
    group = WorkerGroup(mesh.size, "graphpar.runtime.cuda_listing:ListingWorker", jobdir,
                        timeout=timeout, name="CUDA listing")
    try:
        for rank, listing in enumerate(listings):
            (jobdir / f"rank{rank}.calls").write_text(print_listing(listing))
            torch.save(dict(per_rank_inputs[rank]) if hasattr(per_rank_inputs[rank], "keys")
                       else list(per_rank_inputs[rank]), jobdir / f"inputs{rank}.pt")
        (jobdir / "job.json").write_text(json.dumps({
            "mesh": list(mesh.shape), "device_ids": list(mesh.device_ids),
            "axes": [list(a) for a in communicator_axes(listings)], "poison": poison}))
        group.start()
        group.wait(group.send("run"))
        outputs, records, peaks = [], [], []
        for rank in range(mesh.size):
            data = torch.load(jobdir / f"result{rank}.pt", weights_only=True)
            outputs.append(data["outputs"])
            records.append([CommRecord(**{**r, "axes": tuple(r["axes"])})
                            for r in data["records"]])
            peaks.append(int(data["peak"]))
        return ListingResult(SpmdResult(outputs, records, counted=True), peaks)
    finally:
        group.stop()
        shutil.rmtree(jobdir, ignore_errors=True)


class ListingWorker:
    """Rank `rank` of a listing job: its listing over a GlooCommunicator (the worker group
    has initialized torch.distributed)."""

    def __init__(self, jobdir: Path, rank: int, world: int) -> None:
        from graphpar.runtime.gloo import GlooCommunicator
        from graphpar.runtime.launch import read_job

        self.jobdir, self.rank = Path(jobdir), rank
        job, mesh = read_job(self.jobdir, world)
        path = self.jobdir / f"rank{rank}.calls"
        listing = parse_listing(path.read_text(), str(path))
        self.comm = GlooCommunicator(mesh, rank, [tuple(a) for a in job["axes"]])
        self.executor = CpuListingExecutor(listing, self.comm, poison=job["poison"])

    def run(self) -> None:
        inputs = torch.load(self.jobdir / f"inputs{self.rank}.pt", weights_only=True)
        outputs = self.executor.run(inputs)
        self.comm.finish()
        from graphpar.runtime.launch import write_result

        write_result(self.jobdir / f"result{self.rank}.pt",
                     {"outputs": outputs, "peak": self.executor.peak_arena_bytes,
                      "records": [r.as_dict() for r in self.comm.records]})
