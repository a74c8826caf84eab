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
