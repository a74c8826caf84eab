"""One SPMD program through every way graphpar runs IR graphs: bit-identical results.

The lockstep driver (all ranks in this process), a gloo job (one process per rank, a worker
group) and that job's workers running their prepared interpreter a second time all walk the
program with the same interpreter, so outputs and byte records agree exactly.
"""

from __future__ import annotations

import pytest
import torch

from graphpar.backends.interpreter import Interpreter
from graphpar.backends.reference import run
from graphpar.errors import BackendError
from graphpar.ir.parser import parse
from graphpar.runtime.launch import SpmdJob
from graphpar.runtime.spmd import run_spmd_in_process, run_spmd_multiprocess

PROGRAM = """
mesh @mesh = <[2]>
graph @one_program(
    %x: f32[4,8] input,
    %w: f32[8,8] param,
) on @mesh {
  %0 = matmul(%x, %w)                                              : f32[4,8]
  %1 = gelu(%0)                                                    : f32[4,8]
  %2 = all_reduce(%1) {axes=[0], n=2, op="sum"}                    : f32[4,8]
  %3 = all_gather(%2) {axes=[0], n=2, dim=0}                       : f32[8,8]
  %4 = reduce_scatter(%3) {axes=[0], n=2, dim=1, op="sum"}         : f32[8,4]
  %5 = all_to_all(%4) {axes=[0], n=2, split_dim=0, concat_dim=1}   : f32[4,8]
  %6 = local_zero(%5) {axes=[0], n=2, op="sum"}                    : f32[4,8]
  %7 = send(%6) {dst=PEER, tag=1}                                  : f32[4,8]
  %8 = recv() {src=PEER, shape=[4, 8], dtype="f32", tag=1}         : f32[4,8]
  %9 = add(%7, %8)                                                 : f32[4,8]
  return %9 output,
         %5 output
}
"""
TEXTS = [PROGRAM.replace("PEER", str(1 - rank)) for rank in range(2)]


def rank_inputs(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, 8, generator=g), "w": torch.randn(8, 8, generator=g)}
            for _ in range(2)]


def assert_identical(a, b) -> None:
    assert len(a) == len(b)
    for outs_a, outs_b in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_b, strict=True))
    assert a.records == b.records


@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_lockstep_gloo_and_prepared_gloo_runs_are_bit_identical():
    inputs = rank_inputs(0)
    lockstep = run_spmd_in_process(TEXTS, inputs)
    assert [r.op for r in lockstep.records[0]] == [
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv"]
    assert_identical(lockstep, run_spmd_multiprocess(TEXTS, inputs, timeout=60))
    with SpmdJob(TEXTS, timeout=60) as job:
        first = job.run(rank_inputs(1))
        again = job.run(inputs)  # each worker's prepared interpreter, run a second time
    assert_identical(first, run_spmd_in_process(TEXTS, rank_inputs(1)))
    assert_identical(lockstep, again)
    # the ranks exchanged their local_zero results: rank 1 sent zeros
    assert torch.equal(lockstep[0][0], lockstep[0][1])


def test_one_rank_runs_the_same_way_prepared_or_not():
    """Without a communicator the interpreter, reference.run and an interpreter prepared as
    serving prepares it (inference mode, inputs checked once) agree (groups of one run as the
    identity), and a prepared interpreter gives the same result every run."""
    single = parse(PROGRAM.replace("<[2]>", "<[1]>").replace("n=2", "n=1")
                   .split("  %7")[0] + "  return %5 output\n}\n")
    inputs = rank_inputs(2)[0]
    expected = run(single, inputs)
    prepared = Interpreter(single)
    serving = Interpreter(single, checked=("x",), inference=True)
    for _ in range(2):
        assert torch.equal(prepared.run(inputs)[0], expected[0])
        assert torch.equal(serving.run(inputs)[0], expected[0])
    with pytest.raises(BackendError, match="needs the device's rank"):
        run(parse(TEXTS[0]), inputs)
