"""The verifier names the node and the broken invariant."""

import pytest
import torch

from graphpar.errors import IRParseError, VerificationError
from graphpar.ir.graph import Graph, Node, OutputRole, Role
from graphpar.ir.mesh import Mesh, parse_mesh_shape
from graphpar.ir.parser import parse_program
from graphpar.ir.types import TensorType
from graphpar.ir.verify import verify

F32 = torch.float32


def graph_with_linear():
    g = Graph("g")
    x = g.add_input("x", TensorType((4, 16), F32))
    w = g.add_input("w", TensorType((32, 16), F32), Role.PARAM)
    node = g.create("linear", [x, w, None], loc="m.py:3", module="fc")
    g.add_output(node.output)
    return g, node


def test_a_good_graph_verifies():
    g, _ = graph_with_linear()
    verify(g)


def test_wrong_result_type_names_the_node():
    g, node = graph_with_linear()
    node.outputs[0].type = TensorType((4, 33), F32)
    with pytest.raises(VerificationError, match=r"node 0 \(linear\) at m.py:3 in fc: result "
                                                r"types f32\[4,33\] but the op gives f32\[4,32\]"):
        verify(g)


def test_operands_that_do_not_fit():
    g, node = graph_with_linear()
    g.inputs[1].type = TensorType((32, 15), F32)
    with pytest.raises(VerificationError, match="operands do not fit"):
        verify(g)


def test_use_before_definition():
    g, node = graph_with_linear()
    late = Node("relu", [node.output], [node.output.type])
    g.add_node(late, before=node)
    with pytest.raises(VerificationError, match=r"node 0 \(relu\): operand 0 is used before"):
        verify(g)


def test_unknown_op():
    g, node = graph_with_linear()
    node.op = "frobnicate"
    with pytest.raises(VerificationError, match="unknown op 'frobnicate'"):
        verify(g)


def test_update_output_must_name_a_param():
    g, node = graph_with_linear()
    g.add_output(node.output, OutputRole.UPDATE, "x")
    with pytest.raises(VerificationError, match=r"update\(%x\) names no param"):
        verify(g)


def test_a_gradient_may_name_a_floating_point_user_input():
    g, node = graph_with_linear()
    x = g.input("x")
    g.add_output(x, OutputRole.GRAD, "x")  # token slicing: the keys and values of earlier slices
    verify(g)
    ids = g.add_input("ids", TensorType((4, 16), torch.int64))
    g.add_output(ids, OutputRole.GRAD, "ids")
    with pytest.raises(VerificationError, match=r"grad\(%ids\) names no param, buffer or "
                                                r"optimizer-state input \(or, for a gradient, a "
                                                r"floating-point user input\)"):
        verify(g)


def sharded_graph(mesh: str = "2x2"):
    from graphpar.ir.layout import Layout

    g = Graph("s", mesh=Mesh(parse_mesh_shape(mesh)))
    x = g.add_input("x", TensorType((4, 16), F32))
    x.layout = Layout.parse("{S(0),R}")
    node = g.create("relu", [x])
    node.output.layout = Layout.parse("{S(0),R}")
    g.add_output(node.output)
    return g, x, node


def test_layouts_are_checked_against_rank_and_mesh():
    from graphpar.ir.layout import Layout

    g, x, node = sharded_graph()
    verify(g)
    x.layout = Layout.parse("{S(5),R}")
    with pytest.raises(VerificationError, match=r"input %x: layout \{S\(5\),R\} shards dim 5, "
                                                r"but f32\[4,16\] has 2 dim"):
        verify(g)
    x.layout = Layout.parse("{S(0),R,R}")
    with pytest.raises(VerificationError, match="has 3 placement.s. but the graph's mesh 2x2"):
        verify(g)
    x.layout = Layout.parse("{S(0),R}")
    node.output.layout = Layout.parse("{S(1),S(1)}")
    g.inputs[0].type = TensorType((4, 6), F32)
    node.output.type = TensorType((4, 6), F32)
    with pytest.raises(VerificationError, match=r"node 0 \(relu\): result 0: .*not divisible"):
        verify(g)


def test_mesh_declaration_and_collective_axes_are_checked():
    with pytest.raises(IRParseError, match=r"<string>:1:16: expected an axis size, found 'q'"):
        parse_program("mesh @m = <[2, q]>\n")
    g, _, node = sharded_graph()
    gather = g.create("all_gather", [node.output], {"axes": (7,), "n": 2, "dim": 0})
    g.outputs.clear()
    g.add_output(gather.output)
    with pytest.raises(VerificationError, match=r"node 1 \(all_gather\): mesh axis 7 does not "
                                                r"exist: the graph's mesh 2x2 has axes 0..1"):
        verify(g)


def test_a_graph_that_returns_nothing():
    g, _ = graph_with_linear()
    g.outputs.clear()
    with pytest.raises(VerificationError, match="returns nothing"):
        verify(g)


def test_errors_carry_the_node_and_progress_is_reported():
    g, node = graph_with_linear()
    node.outputs[0].type = TensorType((4, 33), F32)
    with pytest.raises(VerificationError) as err:
        verify(g)
    assert err.value.subject is node
    big = Graph("big")
    v = big.add_input("x", TensorType((2,), F32))
    for _ in range(70_000):
        v = big.create("relu", [v]).output
    big.add_output(v)
    calls = []
    verify(big, on_progress=lambda done, total: calls.append((done, total)))
    assert calls == [(65536, 70_000)]
