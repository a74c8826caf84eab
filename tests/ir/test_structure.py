"""Structure up to renaming: layers of module paths, node signatures, node-set signatures."""

import torch

from graphpar.ir.graph import Graph, Role
from graphpar.ir.structure import (
    canonical_order,
    layer_of,
    layer_signature,
    node_signature,
    relayered,
)
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


def test_a_layer_is_the_first_numbered_component_of_a_path():
    assert layer_of("blocks.7.attn.qkv") == ("blocks", 7)
    assert layer_of("model.layers.12") == ("model.layers", 12)
    assert layer_of("blocks.7.experts.3") == ("blocks", 7)
    assert layer_of("lm_head") is None and layer_of(None) is None and layer_of("") is None
    assert layer_of("layer1.conv") is None  # a number inside a name is not a layer
    assert relayered("blocks.7.attn.qkv", "*") == "blocks.*.attn.qkv"
    assert relayered("blocks.7", 9) == "blocks.9"
    assert relayered("lm_head", "*") == "lm_head" and relayered(None, "*") is None


def test_a_layer_of_a_given_stack():
    assert layer_of("enc.0.layers.3.mlp", "enc.0.layers") == ("enc.0.layers", 3)
    assert layer_of("enc.0.layers.3.mlp") == ("enc", 0)
    assert layer_of("head.3.mlp", "enc.0.layers") is None
    assert relayered("enc.0.layers.3.mlp", 8, "enc.0.layers") == "enc.0.layers.8.mlp"
    assert relayered("head.3", 8, "enc.0.layers") == "head.3"  # not in the stack: unchanged


def test_node_signatures_describe_operands_as_asked():
    t = TensorType((4, 8), torch.float32)
    g = Graph("g")
    x, y = g.add_input("x", t), g.add_input("y", t)
    a = g.create("mul", [x, 0.5]).output.producer
    b = g.create("mul", [y, 2.0]).output.producer
    c = g.create("mul", [y, None], output_types=[t]).output.producer
    # by type, inline scalars only by whether they are absent: what strategies depend on
    assert node_signature(a) == node_signature(b) != node_signature(c)
    assert node_signature(a) == ("mul", (), (t, False), (t,))

    def named(v):
        return getattr(v, "name", v)

    assert node_signature(a, named) == ("mul", (), ("x", 0.5), (t,)) != node_signature(b, named)
