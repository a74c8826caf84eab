"""One process per rank over gloo on 127.0.0.1: the same outputs and byte counts as the
in-process executor, and failures that surface as BackendError instead of hanging."""

from __future__ import annotations

import time

import pytest
import torch
from test_spmd_collectives import ALL_OPS_TEXT
from test_spmd_programs import MLP, mlp_case

from graphpar.cost.communication import all_reduce_cost
from graphpar.errors import BackendError
from graphpar.ir.layout import Layout
from graphpar.runtime.spmd import run_spmd_in_process, run_spmd_multiprocess, unshard

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_megatron_mlp_on_four_processes_matches_in_process_and_global():
    _, inputs, mesh, expected = mlp_case()
    local = run_spmd_in_process(MLP, inputs, mesh)
    # gloo's own all-reduce: with groups of two, a + b == b + a, so still bit-identical
    remote = run_spmd_multiprocess(MLP, inputs, mesh, timeout=60, deterministic=False)
    for a, b in zip(local, remote):
        assert torch.equal(a[0], b[0])
    torch.testing.assert_close(unshard([o[0] for o in remote], Layout.parse("{S(0),R}"), mesh),
                               expected)
    predicted = all_reduce_cost(4 * 16 * 4, mesh, 1).bytes_sent
    assert remote.bytes_sent == local.bytes_sent == [predicted] * 4
    assert remote.records == local.records


def test_every_op_on_four_processes_is_bit_identical_to_in_process():
    """Every collective and local step on a 2x2 mesh, then a ring of send/recv (so each rank
    runs its own graph): outputs and per-node byte records agree exactly."""
    texts = [ALL_OPS_TEXT.replace("dst=1", f"dst={(r + 1) % 4}")
             .replace("src=3", f"src={(r - 1) % 4}") for r in range(4)]
    g = torch.Generator().manual_seed(0)
    inputs = [{"x": torch.randn(4, 8, generator=g)} for _ in range(4)]
    local = run_spmd_in_process(texts, inputs)
    remote = run_spmd_multiprocess(texts, inputs, timeout=60)
    for rank in range(4):
        for a, b in zip(local[rank], remote[rank]):
            assert torch.equal(a, b)
        assert torch.equal(remote[rank][1], remote[(rank - 1) % 4][0])  # the ring's message
    assert remote.records == local.records
    assert [r.op for r in remote.records[0]] == [
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_reduce", "send", "recv"]
    assert remote.bytes_sent[0] == pytest.approx(
        2 * 1 / 2 * 128 + 1 / 2 * 256 + 3 / 4 * 256 + 1 / 2 * 64 + 2 * 3 / 4 * 64 + 64)


def test_child_error_surfaces_in_parent_within_timeout():
    text = """
    mesh @mesh = <[2]>
    graph @g(%x: f32[4] input) on @mesh {
      %0 = all_reduce(%x) {axes=[0], n=2, op="sum"} : f32[4]
      return %0 output
    }
    """
    # The parent reports the child's own error, not the timeout it would hit if it waited for
    # the dead rank (no wall-clock bound here: a loaded machine may take long to start ranks).
    with pytest.raises(BackendError, match=r"rank 1 of 2 failed.*input %x expects f32\[4\]"):
        run_spmd_multiprocess(text, [{"x": torch.ones(4)}, {"x": torch.ones(5)}], timeout=120)


def test_a_hung_program_is_killed_at_the_timeout():
    """Both ranks wait for a message nobody sends: killed at the timeout, not hung."""
    text = """
    mesh @mesh = <[2]>
    graph @g(%x: f32[4] input) on @mesh {
      %0 = recv() {src=PEER, shape=[4], dtype="f32", tag=0} : f32[4]
      return %0 output
    }
    """
    start = time.monotonic()
    with pytest.raises(BackendError, match="(?i)timed out"):
        run_spmd_multiprocess([text.replace("PEER", "1"), text.replace("PEER", "0")],
                              [{"x": torch.ones(4)}] * 2, timeout=4)
    assert time.monotonic() - start < 15


@pytest.mark.slow  # `--run-cpu`'s CLI test times steps in the default set
def test_a_job_times_repeated_steps_inside_its_workers_and_still_runs():
    """`SpmdJob.time_steps`: one wall and CPU time per rank per timed step (warm-up steps not
    among them), a step as long as its slowest rank, and with `profile` every node's time,
    collectives included; the same workers then run as before."""
    from graphpar.ir.parser import parse
    from graphpar.runtime.launch import SpmdJob

    _, inputs, mesh, expected = mlp_case()
    with SpmdJob(MLP, mesh, timeout=60) as job:
        times = job.time_steps(inputs, steps=3, warmup=1)
        profiled = job.time_steps(inputs, steps=1, warmup=0, profile=True)
        outputs = job.run(inputs)
    assert times.node_seconds == []
    nodes = parse(MLP).nodes
    assert "all_reduce" in {n.op for n in nodes}
    assert [sorted(per_rank) for per_rank in profiled.node_seconds] == [
        list(range(len(nodes)))] * 4
    assert all(s >= 0 for per_rank in profiled.node_seconds for s in per_rank.values())
    assert len(times.wall) == len(times.cpu) == 4
    assert all(len(w) == 3 for w in times.wall) and times.warmup == 1
    assert times.step_seconds == [max(w[i] for w in times.wall) for i in range(3)]
    assert times.min == min(times.step_seconds) <= times.median <= max(times.step_seconds)
    assert times.as_dict()["step_seconds_each"] == times.step_seconds
    torch.testing.assert_close(unshard([o[0] for o in outputs], Layout.parse("{S(0),R}"), mesh),
                               expected)


def test_step_times_take_the_slowest_rank_and_the_median_over_steps():
    from graphpar.runtime.program import StepTimes

    times = StepTimes(wall=[[1.0, 5.0, 2.0, 9.0], [3.0, 1.0, 1.0, 1.0]],
                      cpu=[[0.5, 0.5, 0.5, 0.5], [1.0, 2.0, 3.0, 4.0]], warmup=2)
    assert times.step_seconds == [3.0, 5.0, 2.0, 9.0]
    assert times.median == 4.0 and times.min == 2.0 and times.steps == 4
    assert times.cpu_median == 2.5


def test_torchrun_runs_a_job_folders_first_run():
    """`torchrun --nproc-per-node 2 -m graphpar.runtime.launch JOBDIR` on the folder an SpmdJob
    wrote (no worker of its own started): each rank reads only torchrun's environment and the
    folder and writes result<rank>.1.pt, the outputs and records the in-process run gives."""
    import os
    import subprocess
    import sys

    from graphpar.runtime.comm import CommRecord
    from graphpar.runtime.jobs import rank_file
    from graphpar.runtime.launch import SpmdJob
    from graphpar.runtime.workers import torchrun_env

    text = """
    mesh @mesh = <[2]>
    graph @g(%x: f32[4] input) on @mesh {
      %0 = all_reduce(%x) {axes=[0], n=2, op="sum"} : f32[4]
      return %0 output
    }
    """
    inputs = [{"x": torch.arange(4.0) + r} for r in range(2)]
    local = run_spmd_in_process(text, inputs)
    env = {k: v for k, v in torchrun_env(0, 2, 0).items()  # graphpar importable, loopback
           if k in ("PYTHONPATH", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")}
    with SpmdJob(text, timeout=60) as job:
        assert job.write_inputs(inputs) == 1
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", "-m", "graphpar.runtime.launch", str(job.jobdir)],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        results = [job.job.folder.load(rank_file("result", r, 1)) for r in range(2)]
    for rank, result in enumerate(results):
        assert torch.equal(result["outputs"][0], local[rank][0])
        assert [CommRecord.from_dict(r) for r in result["records"]] == local.records[rank]
