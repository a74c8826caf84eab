"""Graph node storage: a linked list with O(1) insert and erase, insertion points, stable order."""

import time

import pytest
import torch

from graphpar.ir.graph import Graph, copy_nodes
from graphpar.ir.types import TensorType
from graphpar.passes import PassContext
from graphpar.passes.cleanup import CommonSubexpressionElimination, DeadCodeElimination

T = TensorType((4,), torch.float32)


def chain(n: int) -> Graph:
    """x -> neg -> neg -> ... (n nodes), the last one returned."""
    g = Graph("chain")
    v = g.add_input("x", T)
    for _ in range(n):
        v = g.create("neg", [v], output_types=[T]).output
    g.add_output(v)
    return g


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.nodes]


def test_iteration_length_positions_and_reverse_agree():
    g = chain(5)
    nodes = list(g.nodes)
    assert len(g) == len(g.nodes) == 5 and list(g) == nodes
    assert list(reversed(g.nodes)) == nodes[::-1]
    assert [g.nodes[i] for i in range(5)] == nodes and g.nodes[-1] is nodes[-1]
    assert g.nodes[1:3] == nodes[1:3]
    assert [g.nodes.index(n) for n in nodes] == list(range(5))
    assert all(n in g.nodes for n in nodes)


def test_insert_before_and_erase_keep_order_and_positions_fresh():
    g = chain(3)
    a, b, c = g.nodes
    assert g.nodes.index(c) == 2
    new = g.create("abs", [a.output], output_types=[T], before=b)
    assert ops(g) == ["neg", "abs", "neg", "neg"]
    assert g.nodes.index(c) == 3 and g.nodes[1] is new  # positions follow the edit
    g.erase(new)
    assert ops(g) == ["neg", "neg", "neg"] and len(g) == 3
    assert new not in g.nodes and new.graph is None
    with pytest.raises(ValueError):
        g.nodes.index(new)
    with pytest.raises(ValueError, match="not in graph"):
        g.erase(new)


def test_inserting_before_and_after_put_nodes_in_the_order_created():
    g = chain(2)
    first, last = g.nodes
    with g.inserting_before(last):
        g.create("abs", [first.output], output_types=[T])
        g.create("exp", [first.output], output_types=[T])
    assert ops(g) == ["neg", "abs", "exp", "neg"]
    with g.inserting_after(first):
        g.create("sin", [first.output], output_types=[T])
        g.create("cos", [first.output], output_types=[T])
    assert ops(g) == ["neg", "sin", "cos", "abs", "exp", "neg"]
    with g.inserting_before(None):  # None: the end
        g.create("tanh", [last.output], output_types=[T])
    g.create("relu", [last.output], output_types=[T])  # the insertion point is restored
    assert ops(g)[-2:] == ["tanh", "relu"]


def test_iteration_survives_erasing_the_current_node_and_sees_later_inserts():
    g = chain(4)
    seen = []
    for node in g.nodes:
        seen.append(node)
        if len(seen) == 1:  # an insert after the iterator's position is visited
            g.create("abs", [node.output], output_types=[T], before=g.nodes[1])
        if node.op == "abs":
            g.erase(node)  # erasing where the iterator stands: it goes on to the next node
    assert [n.op for n in seen] == ["neg", "abs", "neg", "neg", "neg"]
    assert ops(g) == ["neg"] * 4


def test_a_node_cannot_be_added_twice_or_before_a_stranger():
    g, other = chain(2), chain(1)
    with pytest.raises(ValueError, match="already in graph"):
        g.add_node(g.nodes[0])
    with pytest.raises(ValueError, match="not in graph"):
        g.create("abs", [g.inputs[0]], output_types=[T], before=other.nodes[0])


def test_an_erased_node_can_be_added_again():
    g = chain(2)
    first, last = g.nodes
    spare = g.create("abs", [first.output], output_types=[T])
    g.erase(spare)
    g.add_node(spare, before=last)
    assert ops(g) == ["neg", "abs", "neg"]


def test_editing_a_big_graph_is_linear():
    """20,000 nodes: a node inserted before each, then CSE and DCE. With a Python list
    (index + insert, remove) this took minutes; linked, about a second."""
    n = 5000
    g = Graph("big")
    v = g.add_input("x", T)
    for _ in range(n):
        live = g.create("neg", [v], output_types=[T])
        g.create("exp", [v], output_types=[T])  # dead
        g.create("neg", [v], output_types=[T])  # a duplicate of `live`
        v = live.output
    g.add_output(v)
    start = time.perf_counter()
    for node in list(g.nodes):
        if node.op == "neg":
            g.create("abs", [node.inputs[0]], output_types=[T], before=node)
    CommonSubexpressionElimination().run_on_graph(g, PassContext())
    DeadCodeElimination().run_on_graph(g, PassContext())
    seconds = time.perf_counter() - start
    assert ops(g) == ["neg"] * n
    assert seconds < 5.0, f"{seconds:.1f} s: node insert/erase is no longer O(1)"


def test_copy_nodes_copies_a_run_of_nodes_into_another_graph():
    g = chain(4)
    g.nodes[1].module, g.nodes[2].attrs["note"] = "blocks.1", 0.5
    sub = Graph("tail")
    start = sub.add_input("h", T)
    mapping = {g.nodes[0].output: start}  # the value the copied run reads from outside
    copy_nodes(g.nodes[1:], sub, mapping)
    assert [n.op for n in sub.nodes] == ["neg"] * 3
    assert sub.nodes[0].inputs == (start,) and sub.nodes[0].module == "blocks.1"
    assert sub.nodes[1].attrs == {"note": 0.5}
    assert mapping[g.nodes[3].output] is sub.nodes[2].output
    assert len(g.nodes) == 4 and g.nodes[1].inputs == (g.nodes[0].output,)  # g is untouched
