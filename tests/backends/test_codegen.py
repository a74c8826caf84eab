"""The interpreter's plan written out as a Python function: the text it runs, a failing line
named by its node, and the same results as walking the plan."""

import pytest
import torch

from graphpar.backends.interpreter import Interpreter
from graphpar.errors import GraphparError
from graphpar.ir.parser import parse

PROGRAM = """
graph @g(%x: f32[4,4] input, %a: f32[4,4] param) {
  %0 = matmul(%x, %a)              : f32[4,4]
  %1 = add(%0, 1.5)                : f32[4,4]
  %2, %3, %4 = layer_norm_with_stats(%1) {shape=[4], eps=1e-05} : f32[4,4], f32[4,1], f32[4,1]
  %5 = reshape(%2) {shape=[2,8]}   : f32[2,8]
  return %5 output, %4 output
}
"""


def test_the_generated_function_reads_as_the_graph():
    assert Interpreter(parse(PROGRAM)).code == '''def step(env):
    v0 = env[0]
    v1 = env[1]
    _r = f0(v0, v1)  # matmul
    v2 = (_r[0] if _r else None) if isinstance(_r, _seq) else _r
    _r = f1(v2, c1_1)  # add
    v3 = (_r[0] if _r else None) if isinstance(_r, _seq) else _r
    del v2
    v4, v5, v6 = _spread(f2(v3, shape=a2_shape, eps=a2_eps), 3)  # layer_norm_with_stats
    del v3
    _r = f3(v4, shape=a3_shape)  # reshape
    v7 = (_r[0] if _r else None) if isinstance(_r, _seq) else _r
    del v4
    return [v7, v6]
'''


def test_it_gives_what_walking_the_plan_gives():
    x, a = torch.randn(4, 4), torch.randn(4, 4)
    interpreter = Interpreter(parse(PROGRAM))
    steps = interpreter.steps({"x": x, "a": a})
    with pytest.raises(StopIteration) as walked, torch.no_grad():
        next(steps)
    ran = interpreter.run({"x": x, "a": a})
    assert all(torch.equal(r, w) for r, w in zip(ran, walked.value.value, strict=True))
    normed, _, rstd = torch.native_layer_norm(x @ a + 1.5, [4], None, None, 1e-5)
    assert torch.equal(ran[0], normed.reshape(2, 8)) and torch.equal(ran[1], rstd)


def test_a_failing_line_names_its_node():
    graph = parse(PROGRAM.replace("shape=[2,8]", "shape=[3,3]").replace("f32[2,8]", "f32[3,3]"))
    with pytest.raises(GraphparError, match=r"graph @g, node 3 \(reshape\) failed to execute: "
                                            r"shape '\[3, 3\]' is invalid"):
        Interpreter(graph).run({"x": torch.randn(4, 4), "a": torch.randn(4, 4)})


def test_an_attribute_python_cannot_spell_as_a_keyword_goes_in_a_dict():
    interpreter = Interpreter(parse("""
graph @g(%x: f32[4] input) {
  %0 = mul(%x, 2.0) : f32[4]
  return %0 output
}
"""))
    index, node, _, operands, _, outs, frees = interpreter.plan[0]
    interpreter.plan = [(index, node, lambda a, b, **kw: a * b + kw["from"], operands,
                         {"from": 1.0}, outs, frees)]  # as a kernel table could give
    assert "_r = f0(v0, c0_1, **a0)  # mul" in interpreter.code
    assert torch.equal(interpreter.run({"x": torch.ones(4)})[0], torch.full((4,), 3.0))
