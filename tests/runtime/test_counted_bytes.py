"""Bytes counted where they leave the process: each gloo rank's records carry the payloads it
handed to torch.distributed (`bytes_counted`), beside the plan's definition (`bytes_sent`);
the in-process executor, with no wire, counts nothing.

The expected counts are worked out here from the tensor sizes and what each gloo primitive
moves: a ring all-gather sends (n-1)·B, a ring all-reduce 2·(n-1)/n·B when the buffer cuts
into 2n equal segments (a ragged one per gloo's segment arithmetic), a send its message."""

from __future__ import annotations

import json
import os
from pathlib import Path
from string import Template

import pytest
import torch

from graphpar.runtime.spmd import run_spmd_in_process, run_spmd_multiprocess

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

PROGRAM = Template("""
mesh @mesh = <[$n]>
graph @g(%x: f32[6,8] input, %y: f32[5] input) on @mesh {
  %0 = all_gather(%x) {axes=[0], n=$n, dim=0}    : f32[$gathered,8]
  %1 = all_reduce(%x) {axes=[0], n=$n, op="sum"} : f32[6,8]
  %2 = all_reduce(%y) {axes=[0], n=$n, op="sum"} : f32[5]
  %3 = send(%x) {dst=$next, tag=1}               : f32[6,8]
  %4 = recv() {src=$prev, shape=[6, 8], dtype="f32", tag=1} : f32[6,8]
  return %0 output, %1 output, %2 output, %3 output, %4 output
}
""")


def programs(n: int) -> list[str]:
    """Every rank's program: the collectives, then a ring of sends."""
    return [PROGRAM.substitute(n=n, gathered=6 * n, next=(r + 1) % n, prev=(r - 1) % n)
            for r in range(n)]


@pytest.mark.parametrize("n, deterministic", [(2, True), (4, False)])
def test_gloo_ranks_count_each_primitives_payload(n, deterministic):
    g = torch.Generator().manual_seed(0)
    inputs = [{"x": torch.randn(6, 8, generator=g), "y": torch.randn(5, generator=g)}
              for _ in range(n)]
    remote = run_spmd_multiprocess(programs(n), inputs, timeout=60,
                                   deterministic=deterministic)
    local = run_spmd_in_process(programs(n), inputs)
    x, y = 6 * 8 * 4, 5 * 4  # bytes
    if deterministic:  # every all-reduce is an all-gather of the input, then a local sum
        reduce_x, reduce_y = [(n - 1) * x] * n, [(n - 1) * y] * n
    else:
        # gloo's ring: 2n segments; x's 192 bytes cut into equal whole-element ones, so each
        # rank sends 2·(n-1) of them, 2·(n-1)/n·B. y's 20 bytes on 4 ranks: 8 segments of 4
        # bytes (the last 3 beyond the buffer), chunks of 2 segments hold 8, 8, 4 and 0
        # bytes; rank r sends all but chunk r (reduce-scatter), then all but chunk r-1
        # (all-gather)
        assert n == 4
        reduce_x = [2 * (n - 1) * x // n] * n
        chunks = [8, 8, 4, 0]
        reduce_y = [(y - chunks[r]) + (y - chunks[r - 1]) for r in range(n)]
        assert reduce_y == [32, 24, 28, 36] and sum(reduce_y) == 2 * (n - 1) * y
    for r in range(n):
        counted = [(rec.op, rec.bytes_counted) for rec in remote.records[r]]
        assert counted == [("all_gather", (n - 1) * x), ("all_reduce", reduce_x[r]),
                           ("all_reduce", reduce_y[r]), ("send", x), ("recv", 0)]
    assert remote.bytes_counted == [(n - 1) * x + reduce_x[r] + reduce_y[r] + x
                                    for r in range(n)]
    # the plan's definition is the executors' common account; only gloo ranks count
    assert remote.records == local.records and remote.bytes_sent == local.bytes_sent
    assert local.bytes_counted is None
    assert all(rec.bytes_counted is None for recs in local.records for rec in recs)


def test_a_packed_message_counts_its_buffer_padding_included(tmp_path, monkeypatch):
    from graphpar.runtime.workers import WorkerGroup

    here = str(Path(__file__).resolve().parent)  # where the workers import the handler from
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p))
    group = WorkerGroup(2, "group_workers:PackedSend", tmp_path, timeout=60, name="test")
    group.start()
    try:
        group.wait(group.send("run"))
    finally:
        group.stop()
    sent, received = (json.loads((tmp_path / f"records{r}.json").read_text()) for r in (0, 1))
    # uint8[3] at 0, then float32[5] at 4 (aligned to its 4 bytes): a 24-byte buffer; each
    # record counts its tensor and the padding before it
    assert [(r["op"], r["bytes_sent"], r["bytes_counted"]) for r in sent] == [
        ("send", 3, 3), ("send", 20, 21)]
    assert sum(r["bytes_counted"] for r in sent) == 4 + 5 * 4
    assert [(r["op"], r["bytes_counted"]) for r in received] == [("recv", 0), ("recv", 0)]
