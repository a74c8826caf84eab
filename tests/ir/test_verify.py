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


def relu_graph(mesh: Mesh | None = None):
    g = Graph("r", mesh=mesh)
    x = g.add_input("x", TensorType((4, 16), F32))
    node = g.create("relu", [x])
    g.add_output(node.output)
    return g, x, node


def test_without_a_mesh_only_replicated_layouts_are_valid():
    from graphpar.ir.layout import Layout

    g, x, node = relu_graph()
    x.layout = node.output.layout = Layout.parse("{R}")
    verify(g)  # replicated: the whole tensor on the one device
    x.layout = Layout.parse("{S(0),R,R}")
    with pytest.raises(VerificationError, match=r"input %x: layout \{S\(0\),R,R\} is not fully "
                                                r"replicated but graph @r is declared on no "
                                                r"mesh; declare the mesh it runs on"):
        verify(g)
    x.layout = Layout.parse("{R}")
    node.output.layout = Layout.parse("{P}")
    with pytest.raises(VerificationError, match=r"node 0 \(relu\): result 0: layout \{P\} "
                                                r"is not fully replicated") as err:
        verify(g)
    assert err.value.subject is node


@pytest.mark.parametrize("op, attrs, operands", [
    ("all_gather", {"axes": (7,), "n": 2, "dim": 0}, 1),
    ("all_reduce", {"axes": [0], "n": 2, "op": "sum"}, 1),
    ("local_slice", {"axes": (0,), "n": 2, "dim": 0}, 1),
    ("send", {"dst": 1, "tag": 0}, 1),
    ("recv", {"src": 1, "shape": (4, 16), "dtype": "f32", "tag": 0}, 0),
])
def test_without_a_mesh_no_spmd_op_is_valid(op, attrs, operands):
    g, _, relu = relu_graph()
    node = g.create(op, [relu.output][:operands], attrs)
    g.add_output(node.outputs[0])
    with pytest.raises(VerificationError, match=rf"graph @r, node 1 \({op}\): {op} runs across "
                                                r"the devices of a mesh but graph @r is declared "
                                                r"on no mesh; declare the mesh it runs on") as err:
        verify(g)
    assert err.value.subject is node
    g.mesh = Mesh((2,))
    if op == "all_gather":
        with pytest.raises(VerificationError, match="mesh axis 7 does not exist"):
            verify(g)
    else:
        verify(g)


def test_collective_axes_given_as_a_list_are_checked_against_the_mesh():
    g, _, relu = relu_graph(Mesh((2, 2)))
    node = g.create("all_reduce", [relu.output], {"axes": [0, 2], "n": 4, "op": "sum"})
    g.add_output(node.output)
    with pytest.raises(VerificationError, match=r"node 1 \(all_reduce\): mesh axis 2 does not "
                                                r"exist: the graph's mesh 2x2 has axes 0..1; "
                                                r"name axes of that mesh"):
        verify(g)


NO_MESH = """\
graph @g(
    %x: f32[4,16] input,
) {
  %0 = relu(%x) : f32[4,16]
  %1 = all_gather(%0) {axes=[7], n=2, dim=0} : f32[8,16]
  return %1 output
}
"""


@pytest.mark.parametrize("old, new, where, says", [
    ("", "", "m.gpir:5:3: graph @g, node 1 (all_gather)",
     "all_gather runs across the devices of a mesh but graph @g is declared on no mesh"),
    ("f32[4,16] input", "f32[4,16] {S(0),R,R} input", "m.gpir:2:5: graph @g: input %x",
     "layout {S(0),R,R} is not fully replicated"),
    ("relu(%x) : f32[4,16]", "relu(%x) : f32[4,16] {R,P}", "m.gpir:4:3: graph @g, node 0 (relu)",
     "result 0: layout {R,P} is not fully replicated"),
])
def test_the_parser_rejects_sharding_without_a_mesh(old, new, where, says):
    with pytest.raises(IRParseError) as err:
        parse_program(NO_MESH.replace(old, new, 1), "m.gpir")
    first = str(err.value).splitlines()[0]
    assert first.startswith(where) and says in first
    # declared on a mesh, the same file names the missing axis instead
    text = "mesh @mesh = <[2, 2]>\n" + NO_MESH.replace(") {", ") on @mesh {", 1)
    with pytest.raises(IRParseError, match=r"m.gpir:6:3: graph @g, node 1 \(all_gather\): mesh "
                                           r"axis 7 does not exist"):
        parse_program(text, "m.gpir")


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
