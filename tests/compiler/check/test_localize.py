"""Where a plan breaks: with a bug planted in a collective or in one compute op of the device
program, the check fails and names the first node of the sharded graph that differs; without
one, no node differs."""

import pytest

import graphpar
import graphpar.runtime.comm as comm
from graphpar.backends import interpreter
from graphpar.capture import Adam
from graphpar.compiler.check.localize import first_difference
from graphpar.models import get_model


@pytest.fixture(scope="module")
def gpt_2x2():
    ex = get_model("gpt", "tiny", train=True)
    return graphpar.compile(ex.module, ex.inputs, mesh="2x2", mode="train", loss_fn=ex.loss_fn,
                            targets=ex.targets, optimizer=Adam(), cluster="cpu", time_limit=10,
                            keep_grads=True)


def test_a_right_plan_differs_nowhere(gpt_2x2):
    assert first_difference(gpt_2x2.captured, gpt_2x2.example_args()).startswith("no node")


def test_a_wrong_reduction_is_found_at_its_reshard(gpt_2x2, monkeypatch):
    reduce = comm.reduce_tensors
    monkeypatch.setattr(comm, "reduce_tensors", lambda ts, op: reduce(ts, op) * (1 + 1e-4))
    check = gpt_2x2.check()
    assert not check.within_tolerance
    where = check.where
    assert where.startswith("%") and "= reshard(" in where, where
    assert "all_reduce" in where or "reduce_scatter" in where, where
    assert "off by" in where and "bound" in where
    assert where in check.verdict()


def test_a_wrong_op_on_the_ranks_is_found_at_the_op(gpt_2x2, monkeypatch):
    planted_gelu(monkeypatch)
    check = gpt_2x2.check()
    assert not check.within_tolerance
    assert "= gelu(" in check.where and "blocks.0.mlp" in check.where, check.where


@pytest.fixture(scope="module")
def gpt_pipeline():
    """GPT in 2 stages over 4 microbatches, the second stage sharded on 1x2."""
    from graphpar.compiler.pipelined import compile_pipeline

    ex = get_model("gpt", "tiny", train=True, batch_size=8)
    pipe = compile_pipeline(ex.module, ex.inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                            optimizer=Adam(), stages=2, microbatches=4, schedule="1f1b",
                            keep_grads=True)
    return pipe.on_submeshes({1: "1x2"})


def planted_gelu(monkeypatch):
    """gelu 1e-4 too large where a device program runs it (a rank with a communicator)."""
    function = interpreter.Interpreter._function

    def planted(self, index, node):
        fn, attrs = function(self, index, node)
        if self.comm is None or node.op != "gelu":
            return fn, attrs
        return (lambda *a, **k: fn(*a, **k) * (1 + 1e-4)), attrs

    monkeypatch.setattr(interpreter.Interpreter, "_function", planted)


def test_a_wrong_op_in_a_sharded_stage_is_found_in_its_stage(gpt_pipeline, monkeypatch):
    planted_gelu(monkeypatch)
    check = gpt_pipeline.check()
    assert not check.within_tolerance
    assert check.where.startswith("stage 1's forward of microbatch 0"), check.where
    assert "on its sub-mesh" in check.where and "= gelu(" in check.where, check.where


def test_a_corrupted_transfer_is_found_between_stages(gpt_pipeline, monkeypatch):
    from graphpar.runtime import pipeline as runtime

    incoming = runtime.StageRunner.incoming

    def corrupt(self, action, names, tensors):
        incoming(self, action, names, [t * (1 + 1e-4) if t.is_floating_point() else t
                                       for t in tensors])

    monkeypatch.setattr(runtime.StageRunner, "incoming", corrupt)
    check = gpt_pipeline.check()
    assert not check.within_tolerance
    assert "arrives at stage" in check.where and "different from what stage" in check.where


def test_a_right_pipeline_passes_and_a_lost_gradient_is_no_stage(gpt_pipeline, monkeypatch):
    assert gpt_pipeline.check(steps=2).within_tolerance
    from graphpar.runtime import pipeline as runtime

    done = runtime.StageRunner._backward_done

    def forget_the_first(self, m):  # microbatch 0's gradients never reach the sums
        if m == 0:
            self.backward_done.add(m)
            return
        done(self, m)

    monkeypatch.setattr(runtime.StageRunner, "_backward_done", forget_the_first)
    check = gpt_pipeline.check()
    assert not check.within_tolerance and check.where.startswith("no stage"), check.where
