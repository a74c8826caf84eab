"""Identical layers: which nodes of a graph are the same place of identical layers.

A model's layers are found by their module paths: `blocks.7.attn` is in layer `blocks.7` of the
stack `blocks.*` (the first numbered component of the path, `graphpar.ir.structure.layer_of`;
graph inputs by their names, `blocks.7.attn.qkv.weight`). Two layers of a stack are identical
when their nodes, in graph order, have equal `node_signature`s (op, attributes, operand and
result types) and equal module paths up to the layer number, and their inputs equal names (up
to the number), types and roles.

The auto-shard ILP gives the nodes in the same place of identical layers one set of variables
(`layer_key`, `input_key`), so a 96-layer model costs what one layer does to solve; the
pipeline-stage DP can cost one layer of a group and reuse it for every member
(`repeated_layers`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

from graphpar.ir.graph import Graph, Node, Value
from graphpar.ir.structure import layer_of, node_signature, relayered


def layer_key(node: Node, index_in_module: int) -> str | None:
    """`blocks.*.attn#3`: equal for the same node of two identical layers (`index_in_module`:
    the node's rank among the nodes of its module with its signature)."""
    if layer_of(node.module) is None:
        return None
    return f"{relayered(node.module, '*')}#{index_in_module}"


def input_key(value: Value) -> str | None:
    """`blocks.*.attn.qkv.weight.exp_avg`: equal for the same input of two identical layers."""
    return None if layer_of(value.name) is None else relayered(value.name, "*")


@dataclass(frozen=True)
class Layer:
    """One layer: its name (`blocks.7`), its nodes and its inputs, in graph order."""

    name: str
    index: int
    nodes: tuple[Node, ...]
    inputs: tuple[Value, ...]


@dataclass(frozen=True)
class LayerGroup:
    """Identical layers of one stack (`blocks.*`), in layer order: node k of every member is
    the same op on the same types, and so are their inputs."""

    stack: str
    layers: tuple[Layer, ...]

    @property
    def representative(self) -> Layer:
        return self.layers[0]

    def same_place(self, k: int) -> tuple[Node, ...]:
        """Node k of every member layer."""
        return tuple(layer.nodes[k] for layer in self.layers)


def repeated_layers(graph: Graph, within: Collection[Node] | None = None) -> list[LayerGroup]:
    """The groups of two or more identical layers in `graph`, by stack and then by first
    layer. A stack whose layers differ (a mixture-of-experts layer every other block) gives
    one group per kind of layer. With `within` (e.g. the forward ops), only those nodes and
    the inputs they read make up the layers. Linear in the graph's size."""
    nodes: dict[tuple[str, int], list[Node]] = defaultdict(list)
    inputs: dict[tuple[str, int], list[Value]] = defaultdict(list)
    for node in graph.nodes:
        where = layer_of(node.module)
        if where is not None and (within is None or node in within):
            nodes[where].append(node)
    for value in graph.inputs:
        where = layer_of(value.name)
        if where is not None and (within is None or any(u in within for u in value.users)):
            inputs[where].append(value)
    by_shape: dict[tuple, list[Layer]] = defaultdict(list)
    for (stack, index) in sorted(set(nodes) | set(inputs)):
        layer = Layer(f"{stack}.{index}", index, tuple(nodes[(stack, index)]),
                      tuple(inputs[(stack, index)]))
        by_shape[(stack, _layer_shape(layer))].append(layer)
    groups = [LayerGroup(stack, tuple(layers)) for (stack, _), layers in by_shape.items()
              if len(layers) > 1]
    return sorted(groups, key=lambda g: (g.stack, g.layers[0].index))


def _layer_shape(layer: Layer) -> tuple:
    """What must be equal for two layers to be identical (names without the layer number)."""
    return (tuple((node_signature(n), relayered(n.module, "*")) for n in layer.nodes),
            tuple((input_key(v), v.type, v.role) for v in layer.inputs))

