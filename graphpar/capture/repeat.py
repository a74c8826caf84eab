"""Capture a stack of identical layers once: trace a few of them, then repeat their IR.

torch.export costs a few milliseconds per traced op, so a 96-layer training step takes a
minute to trace although its layers are all alike. A model whose layers live in one
`nn.ModuleList` of structurally identical blocks (same class, same parameter names, shapes
and dtypes) is traced with only `TRACED_LAYERS` of them; the IR of a middle layer is then
copied for every missing layer. A middle layer of the shallow capture reads only its own
nodes and parameters, its two neighbours' nodes and what all layers share (embeddings,
masks, rotary tables), so each copy `j` reads layer `j-1`'s and `j+1`'s nodes at the same
positions. Anything that does not fit that shape (a layer reading a layer two away, layers
whose traced nodes differ) makes `expand_layers` answer None and the model is traced whole.

Only weightless (meta) captures repeat: their state is shapes, which the copies' names give.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from graphpar.ir.graph import Graph, Node, OutputRole, Value
from graphpar.ir.structure import layer_of, node_signature, relayered

# Layers traced: 0 and 4 are the ends (they differ: the embedding, the head), 1 and 3 are the
# template's neighbours, which a copy's operands are read from, and 2 is the template.
TRACED_LAYERS = 5
TEMPLATE = 2
# Below this depth the whole model is traced: the saving is small.
MIN_LAYERS = 8


@dataclass(frozen=True)
class LayerStack:
    """The `nn.ModuleList` at `path` (e.g. `blocks`, `model.layers`) of `depth` identical
    layers."""

    path: str
    depth: int


def find_layer_stack(module: torch.nn.Module) -> LayerStack | None:
    """The deepest `nn.ModuleList` of structurally identical layers that own their tensors
    (no weight shared with another layer or module), not itself inside a numbered layer, or
    None."""
    owners: dict[int, int] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for t in table.values():
                if t is not None:
                    owners[id(t)] = owners.get(id(t), 0) + 1
    best: LayerStack | None = None
    for path, sub in module.named_modules():
        if not isinstance(sub, torch.nn.ModuleList) or len(sub) < MIN_LAYERS or not path:
            continue
        if any(part.isdigit() for part in path.split(".")):
            continue  # a list inside one layer (its experts): the layers are what repeats
        if best is not None and len(sub) <= best.depth:
            continue
        signatures = {_module_signature(layer) for layer in sub}
        if len(signatures) != 1:
            continue
        if any(owners[id(t)] > 1 for layer in sub for t in _tensors(layer)):
            continue  # a tied weight: the copies would not share it
        best = LayerStack(path, len(sub))
    return best


def _tensors(layer: torch.nn.Module) -> Iterator[torch.Tensor]:
    for _, tensor in layer.named_parameters(remove_duplicate=False):
        yield tensor
    for _, tensor in layer.named_buffers(remove_duplicate=False):
        yield tensor


def _module_signature(layer: torch.nn.Module) -> tuple:
    tensors = [*layer.named_parameters(remove_duplicate=False),
               *layer.named_buffers(remove_duplicate=False)]
    return (type(layer), tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                               for name, t in tensors))


@contextmanager
def truncated(module: torch.nn.Module, stack: LayerStack, depth: int) -> Iterator[None]:
    """For the block, the stack holds only its first `depth` layers."""
    parent_path, _, name = stack.path.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    full = parent._modules[name]
    parent._modules[name] = torch.nn.ModuleList(list(full)[:depth])
    try:
        yield
    finally:
        parent._modules[name] = full


def capture_repeated(module: torch.nn.Module, capture: Callable[[], Graph]) -> Graph | None:
    """The graph of `module` traced with `TRACED_LAYERS` layers of its layer stack and
    expanded to its full depth, or None if it has no stack or its trace does not repeat
    (then trace it whole)."""
    stack = find_layer_stack(module)
    if stack is None:
        return None
    try:
        with truncated(module, stack, TRACED_LAYERS):
            shallow = capture()
    except Exception:  # noqa: BLE001 (e.g. a forward that indexes its layers by the config's count)
        return None  # the whole model is traced next, and reports its own errors
    return expand_layers(shallow, stack.path, stack.depth)


# --- expanding the IR -----------------------------------------------------------------------

SHARED = -1  # a node or input of no layer: read by all of them


class _NotRepeating(Exception):
    """The shallow graph does not have the shape `expand_layers` repeats."""


def expand_layers(graph: Graph, prefix: str, depth: int) -> Graph | None:
    """`graph`, a capture with `TRACED_LAYERS` layers `prefix.0` ... `prefix.4`, with the
    middle one repeated so that it has `depth` layers (None if it does not repeat)."""
    if depth < TRACED_LAYERS:
        raise ValueError(f"cannot expand {TRACED_LAYERS} layers to {depth}")
    try:
        return _Expansion(graph, prefix, depth).build()
    except _NotRepeating:
        return None


class _Expansion:
    """One expansion: the traced graph's nodes by layer, the checks, the expanded graph."""

    def __init__(self, graph: Graph, prefix: str, depth: int):
        self.graph, self.depth, self.prefix = graph, depth, prefix
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.label = self._labels()
        self.layers: dict[int, list[Node]] = {k: [] for k in range(TRACED_LAYERS)}
        for node in graph.nodes:
            if self.label[node] != SHARED:
                self.layers[self.label[node]].append(node)
        self.index_in_layer = {n: p for nodes in self.layers.values()
                               for p, n in enumerate(nodes)}
        self._check_repeats()
        last = depth - 1
        # The traced layers' places in the expanded graph; the template's copies are 2..N-3.
        self.final = {0: 0, 1: 1, 3: last - 1, 4: last}
        self.traced_layer = {place: k for k, place in self.final.items()}
        self.copies = range(TEMPLATE, last - 1)

    # Which layer each node and input belongs to.
    def _layer_of_name(self, name: str | None) -> int:
        where = layer_of(name, self.prefix)
        if where is None:
            return SHARED
        k = where[1]
        if k >= TRACED_LAYERS:
            raise _NotRepeating("a layer index beyond the traced layers")
        return k

    def _labels(self) -> dict[Node, int]:
        """A node's layer is its module's; a node without a module (the joint graph loses
        some) belongs with its most recently computed operand's layer."""
        label: dict[Node, int] = {}
        for node in self.graph.nodes:
            if node.module is not None:
                label[node] = self._layer_of_name(node.module)
                continue
            producers = [v.producer for v in node.input_values if v.producer is not None]
            labelled = [p for p in producers if label[p] != SHARED]
            label[node] = (label[max(labelled, key=self.position.__getitem__)]
                           if labelled else SHARED)
        # A constant made for one layer only (a zero tensor of its backward) is that layer's:
        # every layer has its own in the full trace.
        returned = {o.value for o in self.graph.outputs}
        for node in reversed(self.graph.nodes):
            if node.module is None and label[node] == SHARED and \
                    not any(o in returned for o in node.outputs):
                readers = {label[u] for u in node.users}
                if len(readers) == 1 and SHARED not in readers:
                    label[node] = readers.pop()
        return label

    def _operand_key(self, v, layer: int) -> tuple:
        """What a node of `layer` reads, relative to its layer (so that equal keys in two
        layers mean the same reading)."""
        if not isinstance(v, Value):
            return ("scalar", type(v).__name__, v)
        if v.producer is None:
            k = self._layer_of_name(v.name)
            if k == SHARED:
                return ("input", v.name)
            return ("param", k - layer, self._unlayered(v.name))
        k = self.label[v.producer]
        if k == SHARED:
            return ("shared", self.position[v.producer], v.index)
        return ("node", k - layer, self.index_in_layer[v.producer], v.index)

    def _unlayered(self, name: str | None) -> str | None:
        return relayered(name, "*", self.prefix)

    def _signature(self, node: Node, layer: int, reads: set[int]) -> tuple:
        """The node with its operands relative to `layer`, those in layers outside `reads`
        only as "other", and its module up to the layer number."""
        def operand(v) -> tuple | str:
            key = self._operand_key(v, layer)
            return key if key[0] not in ("node", "param") or key[1] in reads else "other"

        return node_signature(node, operand), self._unlayered(node.module)

    def _check_repeats(self) -> None:
        """The template, layer 2, reads only layers 1 to 3 and the shared values; its nodes
        match layer 1's (reading themselves and the next layer) and layer 3's (reading
        themselves and the previous layer) one for one."""
        template = self.layers[TEMPLATE]
        if not template or any(len(self.layers[k]) != len(template) for k in (1, 3)):
            raise _NotRepeating("the traced layers differ in size")
        for node in template:
            for v in node.inputs:
                key = self._operand_key(v, TEMPLATE)
                if key[0] in ("node", "param") and key[1] not in (-1, 0, 1):
                    raise _NotRepeating(f"the template reads a layer two away ({key})")
                if key[0] == "param" and key[1] != 0:
                    raise _NotRepeating("a layer reads its neighbour's weights")
        for neighbour, reads in ((1, {0, 1}), (3, {-1, 0})):
            for a, b in zip(template, self.layers[neighbour]):
                if self._signature(a, TEMPLATE, reads) != self._signature(b, neighbour, reads):
                    raise _NotRepeating(f"layer {neighbour} differs from the template at "
                                        f"{a.op} ({a.module})")
        for node in self.graph.nodes:  # only neighbours read the template's nodes
            if self.label[node] not in (1, TEMPLATE, 3):
                if any(v.producer is not None and self.label[v.producer] == TEMPLATE
                       for v in node.input_values):
                    raise _NotRepeating(f"{node.op} in {node.module} reads the template layer")

    def rename(self, name: str | None, layer: int) -> str | None:
        return relayered(name, layer, self.prefix)

    # Building the expanded graph.
    def instances(self, node: Node) -> list[int]:
        """The layers of the expanded graph a traced node stands for."""
        k = self.label[node]
        return [SHARED] if k == SHARED else list(self.copies) if k == TEMPLATE else [self.final[k]]

    def node_at(self, layer: int, index: int) -> tuple[Node, int]:
        """The traced node and instance that is node `index` of expanded layer `layer`."""
        if layer in self.copies:
            return self.layers[TEMPLATE][index], layer
        return self.layers[self.traced_layer[layer]][index], layer

    def build(self) -> Graph:
        g = self.graph
        new = Graph(g.name, attrs=dict(g.attrs), mesh=g.mesh)
        inputs: dict[tuple[Value, int], Value] = {}
        emitted_template = False
        for v in g.inputs:
            k = self._layer_of_name(v.name)
            if k == TEMPLATE:
                if emitted_template:
                    continue
                emitted_template = True
                template = [w for w in g.inputs if self._layer_of_name(w.name) == TEMPLATE]
                for j in self.copies:
                    for w in template:
                        inputs[(w, j)] = self._add_input(new, w, self.rename(w.name, j))
            else:
                layer = SHARED if k == SHARED else self.final[k]
                inputs[(v, layer)] = self._add_input(new, v, self.rename(v.name, layer)
                                                     if k != SHARED else v.name)
        values: dict[tuple[Value, int], Value] = {}

        def resolve(v, reader: int, j: int):
            if not isinstance(v, Value):
                return v
            if v.producer is None:
                k = self._layer_of_name(v.name)
                return inputs[(v, SHARED if k == SHARED else j if k == TEMPLATE
                               else self.final[k])]
            return values[self._source(v, reader, j)]

        for node, j in self._order():
            operands = [resolve(v, self.label[node], j) for v in node.inputs]
            module = self.rename(node.module, j) if j != SHARED else node.module
            copy = Node(node.op, operands, [o.type for o in node.outputs], node.attrs,
                        module, node.loc)
            new.add_node(copy)
            for old, fresh in zip(node.outputs, copy.outputs):
                fresh.layout = old.layout
                values[(old, j)] = fresh
        emitted_template = False
        for out in g.outputs:
            k = self._output_layer(out)
            if k == TEMPLATE:
                if emitted_template:
                    continue
                emitted_template = True
                template = [o for o in g.outputs if self._output_layer(o) == TEMPLATE]
                for j in self.copies:
                    for o in template:
                        new.add_output(resolve(o.value, TEMPLATE, j), o.role,
                                       self.rename(o.target, j))
            else:
                layer = SHARED if k == SHARED else self.final[k]
                new.add_output(resolve(out.value, k, layer), out.role,
                               self.rename(out.target, layer) if k != SHARED else out.target)
        return new

    @staticmethod
    def _add_input(graph: Graph, old: Value, name: str) -> Value:
        value = Value(old.type, None, 0, name=name, role=old.role)
        value.layout = old.layout
        graph.inputs.append(value)  # names are unique: the traced ones were, renamed apart
        return value

    def _output_layer(self, out) -> int:
        """The layer an output belongs to: its target's (a gradient, an update), else its
        producer's."""
        v = out.value
        made = self.label[v.producer] if v.producer is not None else self._layer_of_name(v.name)
        k = self._layer_of_name(out.target)
        if k == SHARED:
            return made
        if made != SHARED and abs(made - k) > 1:
            raise _NotRepeating(f"output {out.target} reads a layer two away")
        return k

    def _source(self, v: Value, reader: int, j: int) -> tuple[Value, int]:
        """The (traced value, instance) that instance `j` of a reader in traced layer `reader`
        reads as `v`: the same node of a neighbouring layer when either side is a copy."""
        k = self.label[v.producer]
        if k == SHARED:
            return v, SHARED
        if reader == TEMPLATE:  # a copy reads its own layer or a neighbour, by position
            node, layer = self.node_at(j + k - TEMPLATE, self.index_in_layer[v.producer])
            return node.outputs[v.index], layer
        if k == TEMPLATE:  # layer 1 reads the first copy, layer 3 the last
            if reader not in (1, 3):
                raise _NotRepeating(f"layer {reader} reads the template layer")
            return v, self.final[reader] + k - reader
        return v, self.final[k]

    def _order(self) -> list[tuple[Node, int]]:
        """Every (traced node, instance) in an order that keeps operands before their users
        and otherwise follows the trace: the copies of a node go in layer order before the
        loss and in reverse layer order after it (the backward walks the layers back)."""
        loss = next((o.value.producer for o in self.graph.outputs
                     if o.role is OutputRole.LOSS and o.value.producer is not None), None)
        backward_from = self.position[loss] if loss is not None else len(self.position)
        items = [(node, j) for node in self.graph.nodes for j in self.instances(node)]

        template = [self.position[n] for n in self.layers[TEMPLATE]]
        # Copies go layer by layer where the template's first forward (backward) node was.
        starts = (min((p for p in template if p <= backward_from), default=0),
                  min((p for p in template if p > backward_from), default=0))

        def key(item: tuple[Node, int]) -> tuple[int, int, int]:
            node, j = item
            p = self.position[node]
            if j not in self.copies or self.label[node] != TEMPLATE:
                return (p, 0, p)
            if p <= backward_from:
                return (starts[0], j, p)
            return (starts[1], -j, p)

        waiting: dict[tuple[Node, int], int] = {}
        users: dict[tuple[Node, int], list[tuple[Node, int]]] = {}
        for item in items:
            node, j = item
            deps = {self._source(v, self.label[node], j) for v in node.input_values
                    if v.producer is not None}
            deps = {(s.producer, layer) for s, layer in deps}
            waiting[item] = len(deps)
            for d in deps:
                users.setdefault(d, []).append(item)
        ready = [(key(i), id(i[0]), i) for i in items if waiting[i] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, _, item = heapq.heappop(ready)
            order.append(item)
            for user in users.get(item, ()):
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, (key(user), id(user[0]), user))
        if len(order) != len(items):
            raise _NotRepeating("the copies' reads form a cycle")
        return order
