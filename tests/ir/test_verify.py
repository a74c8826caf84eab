"""The verifier names the node and the broken invariant."""

import pytest
import torch

from graphpar.errors import VerificationError
from graphpar.ir.graph import Graph, Node, OutputRole, Role
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
