"""Bucketed all-reduces overlapped with compute (graphpar.runtime.overlap): which buckets a
program gets, and that gloo ranks running them give the results of the plain path, bit for bit,
with the same byte records per node."""

from __future__ import annotations

import pytest
import torch

from graphpar.ir.parser import parse
from graphpar.ir.printer import print_graph
from graphpar.runtime.launch import SpmdJob
from graphpar.runtime.overlap import Bucket, defer_reduced, plan_buckets
from graphpar.runtime.spmd import run_spmd_multiprocess

# a backward's shape: three gradients computed one after another, then each all-reduced right
# where its update reads it (as lower-spmd places a data-parallel step's all-reduces)
STEP = """
mesh @mesh = <[2]>
graph @g(%x: f32[4,8] input, %a: f32[8,8] param, %b: f32[8,16] param, %c: f32[16,16] param)
    on @mesh {
  %0 = matmul(%x, %a)                             : f32[4,8]
  %1 = permute(%x) {dims=[1, 0]}                  : f32[8,4]
  %2 = matmul(%1, %0)                             : f32[8,8]
  %3 = matmul(%0, %b)                             : f32[4,16]
  %4 = matmul(%1, %3)                             : f32[8,16]
  %5 = permute(%3) {dims=[1, 0]}                  : f32[16,4]
  %6 = matmul(%5, %3)                             : f32[16,16]
  %7 = all_reduce(%2) {axes=[0], n=2, op="sum"}   : f32[8,8]
  %8 = sub(%a, %7)                                : f32[8,8]
  %9 = all_reduce(%4) {axes=[0], n=2, op="sum"}   : f32[8,16]
  %10 = sub(%b, %9)                               : f32[8,16]
  %11 = all_reduce(%6) {axes=[0], n=2, op="avg"}  : f32[16,16]
  %12 = sub(%c, %11)                              : f32[16,16]
  %13 = all_reduce(%11) {axes=[0], n=2, op="sum"} : f32[16,16]
  return %8 output, %10 output, %12 output, %13 output
}
"""


def test_all_reduces_go_in_buckets_launched_when_their_operands_are_ready():
    graph = parse(STEP)
    # one bucket per reduce op; %13 reduces %11's result, which a bucket delivers: it runs
    # where it is
    assert plan_buckets(graph) == [
        Bucket((7, 9), launch_after=4, wait_before=8, nbytes=(64 + 128) * 4),
        Bucket((11,), launch_after=6, wait_before=12, nbytes=256 * 4)]
    # a bucket closes once it holds `bucket_bytes`: %7 goes as soon as %2 is computed
    assert plan_buckets(graph, bucket_bytes=64 * 4)[:2] == [
        Bucket((7,), launch_after=2, wait_before=8, nbytes=64 * 4),
        Bucket((9,), launch_after=4, wait_before=10, nbytes=128 * 4)]


def test_a_bucket_never_waits_for_a_result_read_before_its_launch():
    # %3 reads the first all-reduce's result before the second gradient (%4) exists
    graph = parse("""
mesh @mesh = <[2]>
graph @g(%x: f32[4,4] input, %a: f32[4,4] param) on @mesh {
  %0 = mul(%x, 2.0)                             : f32[4,4]
  %1 = all_reduce(%0) {axes=[0], n=2, op="sum"} : f32[4,4]
  %2 = add(%a, %1)                              : f32[4,4]
  %3 = mul(%2, %x)                              : f32[4,4]
  %4 = all_reduce(%3) {axes=[0], n=2, op="sum"} : f32[4,4]
  return %4 output
}
""")
    assert plan_buckets(graph) == [Bucket((1,), 0, 2, 64), Bucket((4,), 3, 5, 64)]


# as a training step's program has it: each layer's update right after its gradient's
# all-reduce, the loss's all-reduce in the forward, which the backward reads
LAYERWISE = """
mesh @mesh = <[2]>
graph @g(%x: f32[4,4] input, %a: f32[4,4] param, %b: f32[4,4] param) on @mesh {
  %0 = matmul(%x, %a)                           : f32[4,4]
  %1 = sum(%0)                                  : f32[]
  %2 = all_reduce(%1) {axes=[0], n=2, op="avg"} : f32[]
  %3 = mul(%x, %2)                              : f32[4,4]
  %4 = all_reduce(%3) {axes=[0], n=2, op="sum"} : f32[4,4]
  %5 = sub(%b, %4)                              : f32[4,4]
  %6 = mul(%3, %0)                              : f32[4,4]
  %7 = all_reduce(%6) {axes=[0], n=2, op="sum"} : f32[4,4]
  %8 = sub(%a, %7)                              : f32[4,4]
  return %2 loss, %5 update(%b), %8 update(%a)
}
"""


def test_updates_wait_until_the_backward_is_done_so_one_bucket_overlaps_it():
    graph = parse(LAYERWISE)
    assert [b.members for b in plan_buckets(graph)] == [(2,), (4,), (7,)]
    assert defer_reduced(graph) == 4  # %4, %5, %7, %8; the loss's all-reduce stays
    assert [n.op for n in graph.nodes] == ["matmul", "sum", "all_reduce", "mul", "mul",
                                           "all_reduce", "sub", "all_reduce", "sub"]
    assert plan_buckets(graph) == [Bucket((2,), 1, 3, 4), Bucket((5, 7), 4, 6, 128)]
    assert "%6 = sub(%b, %5)" in print_graph(graph)  # the same program, renumbered


# the loss's all-reduce read by nothing but the user: it waits for the gradients' bucket
LOSS_APART = LAYERWISE.replace('op="avg"', 'op="sum"').replace("mul(%x, %2)", "mul(%x, %0)")


def test_the_losss_all_reduce_joins_the_gradients_bucket_when_the_backward_does_not_read_it():
    graph = parse(LOSS_APART)
    assert [b.members for b in plan_buckets(graph)] == [(2,), (4,), (7,)]
    assert defer_reduced(graph) == 5  # %2 as well as %4, %5, %7, %8
    assert [n.op for n in graph.nodes] == ["matmul", "sum", "mul", "mul", "all_reduce",
                                           "all_reduce", "sub", "all_reduce", "sub"]
    assert plan_buckets(graph) == [Bucket((4, 5, 7), 3, 6, 132)]  # one rendezvous a step


def test_the_interpreter_refuses_buckets_it_cannot_run():
    from graphpar.backends.interpreter import Interpreter
    from graphpar.errors import BackendError
    from graphpar.runtime.comm import Communicator

    graph = parse(STEP)
    with pytest.raises(BackendError, match="need a communicator with launch_all_reduce"):
        Interpreter(graph, Communicator(graph.mesh, 0), buckets=plan_buckets(graph))
    with pytest.raises(BackendError, match="not a bucket of all-reduces"):
        Interpreter(graph, _Launching(graph.mesh, 0), buckets=[Bucket((7, 8), 6, 9, 0)])
    with pytest.raises(BackendError, match="not a bucket of all-reduces"):  # waits too soon
        Interpreter(graph, _Launching(graph.mesh, 0), buckets=[Bucket((7,), 6, 7, 0)])


class _Launching:
    """A communicator that could launch buckets (the interpreter checks them first)."""

    def __init__(self, mesh, rank):
        self.mesh, self.rank = mesh, rank

    def launch_all_reduce(self, requests):
        raise AssertionError("not run")


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("program, deterministic, bucket_bytes", [
    # what training runs: gloo's all-reduce, the updates deferred, two gradients in a bucket
    (LAYERWISE, False, 1 << 20),
    (LOSS_APART, False, 1 << 20),  # the loss's all-reduce in the gradients' bucket
    pytest.param(STEP, True, 64 * 4, marks=pytest.mark.slow),  # all-gather and sum
])
def test_bucketed_ranks_give_the_plain_results_bit_for_bit(program, deterministic,
                                                           bucket_bytes):
    g = torch.Generator().manual_seed(0)
    graph = parse(program)
    state = {v.name: torch.randn(v.type.shape, generator=g) for v in graph.inputs
             if v.name != "x"}
    inputs = [{"x": torch.randn(graph.input("x").type.shape, generator=g), **state}
              for _ in range(2)]
    # on two ranks each element is one addition of two values, whichever way it is reduced
    plain = run_spmd_multiprocess(program, inputs, timeout=60, deterministic=False)
    with SpmdJob(program, timeout=60, deterministic=deterministic,
                 bucket_bytes=bucket_bytes) as job:
        first, bucketed = job.run(inputs), job.run(inputs)  # the second as the next step
    for rank in range(2):
        assert first.records[rank] == bucketed.records[rank]
        assert all(torch.equal(a, b) for a, b in zip(first[rank], bucketed[rank]))
        for got, want in zip(bucketed[rank], plain[rank], strict=True):
            assert torch.equal(got, want)
        # a record per node (the plan's bytes), whenever its bucket launched it; with the
        # updates deferred, nodes are numbered as they run
        def key(r):
            return (r.op, r.nbytes, r.bytes_sent)
        assert sorted(map(key, bucketed.records[rank])) == sorted(map(key, plain.records[rank]))
    assert bucketed.bytes_sent == plain.bytes_sent
    # the sums are real: rank 0's update of %a takes the two ranks' gradients added
    a, b = state["a"], state["b"]
    if program is STEP:
        want = a - sum(x.T @ (x @ a) for x in (i["x"] for i in inputs))
    elif program is LOSS_APART:
        xs = [i["x"] for i in inputs]
        assert torch.allclose(bucketed[0][0], sum((x @ a).sum() for x in xs))
        assert torch.allclose(bucketed[0][1], b - sum(x * (x @ a) for x in xs))
        want = a - sum(x * (x @ a) * (x @ a) for x in xs)
    else:
        loss = sum((i["x"] @ a).sum() for i in inputs) / 2
        want = a - sum((i["x"] * loss) * (i["x"] @ a) for i in inputs)
        assert torch.allclose(bucketed[0][1], b - sum(i["x"] * loss for i in inputs))
    assert torch.allclose(bucketed[0][0 if program is STEP else -1], want, rtol=1e-5,
                          atol=1e-5)
