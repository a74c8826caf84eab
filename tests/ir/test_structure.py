"""Structure up to renaming: layers of module paths, node signatures, node-set signatures."""

import torch

from graphpar.ir.graph import Graph, Role
from graphpar.ir.structure import canonical_order, layer_signature
from graphpar.ir.types import TensorType


def test_canonical_order_lists_the_same_layer_alike_whatever_its_order():
    g = Graph("two")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    w = g.add_input("w", TensorType((8, 8), torch.float32), Role.PARAM)
    a1 = g.create("relu", [x]).output
    b1 = g.create("matmul", [x, w]).output
    g.add_output(g.create("add", [a1, b1]).output)
    b2 = g.create("matmul", [x, w]).output  # the same three ops, emitted in the other order
    a2 = g.create("relu", [x]).output
    g.add_output(g.create("add", [a2, b2]).output)
    nodes = list(g.nodes)
    first, second = nodes[:3], nodes[3:]
    assert layer_signature(first) != layer_signature(second)
    assert layer_signature(canonical_order(first)) == layer_signature(canonical_order(second))
    assert [n.op for n in canonical_order(first)] == [n.op for n in canonical_order(second)]
    assert canonical_order(first)[-1].op == "add"  # still topological
