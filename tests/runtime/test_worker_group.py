"""The worker group: ranks started torchrun-style, commands run in order, a dead rank named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from graphpar.errors import BackendError
from graphpar.runtime.workers import WorkerGroup

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_a_group_runs_commands_and_names_a_dead_rank_with_its_log(tmp_path, monkeypatch):
    here = str(Path(__file__).resolve().parent)  # where the workers import the handler from
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p))
    group = WorkerGroup(2, "group_workers:Echo", tmp_path, timeout=60, name="test")
    group.start()
    try:
        group.wait_started()
        group.wait(group.send("write", "hello"))
        assert [(tmp_path / f"out{r}.txt").read_text() for r in range(2)] == [
            f"hello from rank {r} of 2 (world 2)" for r in range(2)]
        with pytest.raises(BackendError,
                           match=r"test rank 1 exited with code 3[\s\S]*rank about to exit"):
            group.wait(group.send("die", 1))
        with pytest.raises(BackendError, match="stopped"):
            group.send("write", "again")
    finally:
        group.stop()
    assert all(p.poll() is not None for p in group.processes.values())
