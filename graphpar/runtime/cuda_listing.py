"""Run CUDA listings on CPU ranks: one listing per rank, NCCL calls over gloo.

One rank with no communication runs in this process. Several ranks run as a job
(`graphpar.runtime.jobs`), one worker process per rank: each worker reads its listing's text
from the job folder, makes a `GlooCommunicator` for the mesh-axis groups the listings name,
and runs the listing call for call with `graphpar.backends.cuda.cpu_executor.CpuListingExecutor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from graphpar.backends.cuda.cpu_executor import CpuListingExecutor
from graphpar.errors import BackendError
from graphpar.ir.cuda_listing import Listing, parse_listing, print_listing
from graphpar.ir.mesh import Mesh
from graphpar.runtime.comm import CommRecord
from graphpar.runtime.jobs import Job, JobWorker, mesh_entry
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
    with Job(mesh.size, "graphpar.runtime.cuda_listing:ListingWorker", prefix="cuda",
             timeout=timeout, name="CUDA listing") as job:
        for rank, listing in enumerate(listings):
            job.folder.write_text(f"rank{rank}.calls", print_listing(listing))
        job.save_each("inputs", [dict(inputs) if hasattr(inputs, "keys") else list(inputs)
                                 for inputs in per_rank_inputs])
        job.folder.describe({**mesh_entry(mesh),
                             "axes": [list(a) for a in communicator_axes(listings)],
                             "poison": poison})
        results = job.call("run")
    return ListingResult(
        SpmdResult([r["outputs"] for r in results],
                   [[CommRecord.from_dict(d) for d in r["records"]] for r in results],
                   counted=True),
        [int(r["peak"]) for r in results])


class ListingWorker(JobWorker):
    """Rank `rank` of a listing job: its listing over a GlooCommunicator (the worker group
    has initialized torch.distributed)."""

    def __init__(self, jobdir: Path, rank: int, world: int) -> None:
        from graphpar.runtime.gloo import GlooCommunicator

        super().__init__(jobdir, rank, world)
        name = f"rank{rank}.calls"
        listing = parse_listing(self.folder.read_text(name), str(self.folder.path / name))
        self.comm = GlooCommunicator(self.folder.mesh(world=world), rank,
                                     [tuple(a) for a in self.job["axes"]])
        self.executor = CpuListingExecutor(listing, self.comm, poison=self.job["poison"])

    def run(self) -> dict:
        outputs = self.executor.run(self.load_own("inputs"))
        self.comm.finish()
        return {"outputs": outputs, "peak": self.executor.peak_arena_bytes,
                "records": [r.as_dict() for r in self.comm.records]}
