"""Worker handlers for tests of graphpar.runtime.workers (imported by the worker processes)."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist


class Echo:
    """Writes what it is told to a file per rank (with the process group's size); can die."""

    def __init__(self, jobdir: Path, rank: int, world: int) -> None:
        self.jobdir, self.rank, self.world = jobdir, rank, world

    def write(self, text: str) -> None:
        (self.jobdir / f"out{self.rank}.txt").write_text(
            f"{text} from rank {self.rank} of {self.world} (world {dist.get_world_size()})")

    def die(self, rank: int) -> None:
        if self.rank == rank:
            print("rank about to exit", flush=True)
            os._exit(3)


class PackedSend:
    """Rank 0 sends rank 1 a packed message of a uint8[3] and a float32[5] over a
    GlooCommunicator; each rank writes its byte records to records<rank>.json."""

    def __init__(self, jobdir: Path, rank: int, world: int) -> None:
        from graphpar.ir.mesh import Mesh
        from graphpar.runtime.gloo import GlooCommunicator

        self.jobdir, self.rank = Path(jobdir), rank
        self.comm = GlooCommunicator(Mesh((world,), tuple(range(world))), axes=())

    def run(self) -> None:
        import json

        import torch

        from graphpar.ir.types import TensorType

        parts = [torch.arange(3, dtype=torch.uint8), torch.ones(5)]
        if self.rank == 0:
            self.comm.send_packed(parts, 1, tag=4)
        else:
            self.comm.post_packed([TensorType.of(t) for t in parts], 0, tag=4).wait()
        self.comm.finish()
        (self.jobdir / f"records{self.rank}.json").write_text(
            json.dumps([r.as_dict() for r in self.comm.records]))
