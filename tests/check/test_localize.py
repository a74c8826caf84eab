"""Where a plan breaks: with a bug planted in a collective or in one compute op of the device
program, the check fails and names the first node of the sharded graph that differs; without
one, no node differs."""

import pytest

import graphpar
import graphpar.runtime.comm as comm
from graphpar.backends import interpreter
from graphpar.capture import Adam
from graphpar.check.localize import first_difference
from graphpar.models import get_model


@pytest.fixture(scope="module")
def gpt_2x2():
    ex = get_model("gpt", "tiny", train=True)
    return graphpar.compile(ex.module, ex.inputs, mesh="2x2", mode="train", loss_fn=ex.loss_fn,
                            targets=ex.targets, optimizer=Adam(), cluster="cpu", time_limit=10,
                            keep_grads=True)


def test_a_right_plan_differs_nowhere(gpt_2x2):
    assert first_difference(gpt_2x2).startswith("no node")


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
    function = interpreter.Interpreter._function

    def planted(self, index, node):
        fn, attrs = function(self, index, node)
        if self.comm is None or node.op != "gelu":
            return fn, attrs
        return (lambda *a, **k: fn(*a, **k) * (1 + 1e-4)), attrs

    monkeypatch.setattr(interpreter.Interpreter, "_function", planted)
    check = gpt_2x2.check()
    assert not check.within_tolerance
    assert "= gelu(" in check.where and "blocks.0.mlp" in check.where, check.where
