"""The IR: SSA `Value`s produced by `Node`s, ordered in a `Graph`; several graphs in a `Program`."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Union, overload

from graphpar.ir.mesh import Mesh
from graphpar.ir.types import TensorType

# A node operand is an SSA value or a plain scalar written inline (`mul(%3, 0.125)`), as in fx.
Scalar = Union[int, float, bool, None]  # noqa: UP007 (a runtime alias)
Operand = Union["Value", Scalar]  # noqa: UP007


class Role(str, enum.Enum):
    """What a graph input is: it decides how it is sharded, saved and updated."""

    INPUT = "input"  # an activation fed by the user (token ids, images, targets)
    PARAM = "param"
    BUFFER = "buffer"  # non-trainable state (batch-norm running stats, rotary tables)
    OPTIM_STATE = "optim_state"  # optimizer moments, step counters
    CONST = "const"  # a tensor constant lifted out of the model


# The state a step reads and hands on to the next one: it persists across steps.
PERSISTENT_ROLES = (Role.PARAM, Role.BUFFER, Role.OPTIM_STATE)


class OutputRole(str, enum.Enum):
    """What a graph output is."""

    OUTPUT = "output"  # a user-visible result
    LOSS = "loss"
    GRAD = "grad"  # the gradient of the input named by `Output.target`
    UPDATE = "update"  # the new value of the param/buffer/optim_state named by `Output.target`


class Value:
    """An SSA value: its type, the node that produces it (None for graph inputs) and its users."""

    __slots__ = ("type", "producer", "index", "users", "name", "role", "layout")

    def __init__(
        self,
        type: TensorType,
        producer: Node | None = None,
        index: int = 0,
        name: str | None = None,
        role: Role | None = None,
    ):
        self.type = type
        self.producer = producer
        self.index = index  # which output of the producer this is
        self.users: dict[Node, None] = {}  # ordered set of consuming nodes
        self.name = name  # graph inputs keep their names; node outputs are numbered when printed
        self.role = role
        self.layout: Any = None  # a graphpar.ir.layout.Layout once a sharding pass has run

    @property
    def is_input(self) -> bool:
        return self.producer is None

    def __repr__(self) -> str:
        where = (f"input {self.name}" if self.producer is None
                 else f"{self.producer.op}#{self.index}")
        return f"Value({where}: {self.type})"


def plain(value: Any) -> Any:
    """Attributes are plain, hashable data: lists become tuples, so printing and parsing agree."""
    if isinstance(value, (list, tuple)):
        return tuple(plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"attribute value {value!r} is not plain data (int, float, bool, str, "
                    "None or a tuple of them)")


class Node:
    """One operation: an op name from the registry, operands, result values and plain attributes."""

    __slots__ = ("op", "inputs", "outputs", "attrs", "module", "loc", "graph", "_prev", "_next")

    def __init__(
        self,
        op: str,
        inputs: Sequence[Operand],
        output_types: Sequence[TensorType],
        attrs: dict[str, Any] | None = None,
        module: str | None = None,
        loc: str | None = None,
    ):
        self.op = op
        self.inputs: tuple[Operand, ...] = tuple(inputs)
        self.outputs = tuple(Value(t, self, i) for i, t in enumerate(output_types))
        self.attrs: dict[str, Any] = {k: plain(v) for k, v in (attrs or {}).items()}
        self.module = module  # the nn.Module path the node came from, e.g. "blocks.0.attn"
        self.loc = loc  # the user's source line, e.g. "gpt.py:42"
        self.graph: Graph | None = None
        # Neighbours in the graph's NodeList (its sentinel at either end).
        self._prev: Node | _Sentinel | None = None
        self._next: Node | _Sentinel | None = None

    @property
    def output(self) -> Value:
        """The single result of a one-output node."""
        if len(self.outputs) != 1:
            raise ValueError(f"{self.op} has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    @property
    def input_values(self) -> list[Value]:
        return [v for v in self.inputs if isinstance(v, Value)]

    @property
    def users(self) -> list[Node]:
        seen: dict[Node, None] = {}
        for out in self.outputs:
            seen.update(out.users)
        return list(seen)

    def replace_input(self, old: Value, new: Operand) -> None:
        self.inputs = tuple(new if v is old else v for v in self.inputs)
        old.users.pop(self, None)
        if isinstance(new, Value):
            new.users[self] = None

    def __repr__(self) -> str:
        return f"Node({self.op}, {len(self.inputs)} in, {len(self.outputs)} out)"


class _Sentinel:
    """The ends of a NodeList's ring: one object is both the head and the tail."""

    __slots__ = ("_prev", "_next")

    def __init__(self) -> None:
        self._prev: Node | _Sentinel = self
        self._next: Node | _Sentinel = self


class NodeList:
    """A graph's nodes in order, as a doubly linked list, as torch.fx keeps them.

    Inserting and erasing are O(1) and leave iteration in progress valid: an iterator that is
    on a node when it is erased goes on to the node that followed it, and a node inserted after
    the iterator's position is visited. Positional reads (`nodes[i]`, `nodes[a:b]`,
    `nodes.index(n)`) go through an array of the order built on first use after an edit, so a
    pass that reads positions between edits pays O(n) per edit, not per read.

    It belongs to one Graph, which sets `node.graph` before linking a node and clears it after
    unlinking: that is what membership is, and how iterators tell erased nodes.
    """

    __slots__ = ("_root", "_len", "_order", "_position")

    def __init__(self) -> None:
        self._root = _Sentinel()
        self._len = 0
        self._order: list[Node] | None = None
        self._position: dict[Node, int] | None = None

    # --- editing: O(1) -------------------------------------------------------------------------

    def insert_before(self, anchor: Node | _Sentinel, node: Node) -> None:
        """Link `node` in front of `anchor` (the sentinel: at the end)."""
        if anchor is not self._root and anchor not in self:
            raise ValueError(f"cannot insert before {anchor!r}: it is not in this node list")
        prev = anchor._prev
        node._prev, node._next = prev, anchor
        prev._next = anchor._prev = node
        self._len += 1
        self._order = self._position = None

    def insert_after(self, anchor: Node, node: Node) -> None:
        self.insert_before(anchor._next, node)

    def append(self, node: Node) -> None:
        self.insert_before(self._root, node)

    def remove(self, node: Node) -> None:
        """Unlink `node`. Its own links stay, so that an iterator standing on it can go on."""
        if node not in self:
            raise ValueError(f"{node.op} is not in this node list")
        node._prev._next, node._next._prev = node._next, node._prev
        self._len -= 1
        self._order = self._position = None

    # --- reading -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Node]:
        root, node = self._root, self._root._next
        while node is not root:
            if node.graph is not None:  # an erased node keeps its links: step over it
                yield node
            node = node._next

    def __reversed__(self) -> Iterator[Node]:
        root, node = self._root, self._root._prev
        while node is not root:
            if node.graph is not None:
                yield node
            node = node._prev

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, node: object) -> bool:
        return (isinstance(node, Node) and node.graph is not None
                and node.graph.nodes is self)

    @overload
    def __getitem__(self, i: int) -> Node: ...

    @overload
    def __getitem__(self, i: slice) -> list[Node]: ...

    def __getitem__(self, i: int | slice) -> Node | list[Node]:
        return self._array()[i]

    def index(self, node: Node) -> int:
        """The position of `node` (O(1) between edits)."""
        if self._position is None:
            self._position = {n: k for k, n in enumerate(self._array())}
        try:
            return self._position[node]
        except KeyError:
            raise ValueError(f"{node!r} is not in this node list") from None

    def after(self, node: Node | None) -> Iterator[Node]:
        """The nodes that follow `node` (all of them for None), in order: O(their number)."""
        root = self._root
        current = root._next if node is None else node._next
        while current is not root:
            if current.graph is not None:
                yield current
            current = current._next

    def _array(self) -> list[Node]:
        if self._order is None:
            self._order = list(self)
        return self._order

    def __repr__(self) -> str:
        return f"NodeList({self._len} nodes)"


@dataclass(eq=False)
class Output:
    """A graph result, with what it is (and for grads/updates, which input it belongs to)."""

    value: Value
    role: OutputRole = OutputRole.OUTPUT
    target: str | None = None


@dataclass(eq=False)
class Graph:
    """Nodes in topological order between named, role-tagged inputs and tagged outputs."""

    name: str = "main"
    inputs: list[Value] = field(default_factory=list)
    nodes: NodeList = field(default_factory=NodeList)
    outputs: list[Output] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    # The device mesh the graph is planned on (set by auto-shard; a device program keeps it).
    mesh: Mesh | None = None
    # Where `add_node`/`create` put a node given no `before`: None appends (see `inserting_before`).
    _insert: Callable[[Node], None] | None = field(default=None, init=False, repr=False)
    # The input names, for add_input's check; rebuilt when `inputs` was changed by hand (a new
    # list or a new length), so that adding n inputs stays O(n).
    _input_names: tuple[int, int, set[str]] | None = field(default=None, init=False, repr=False)

    # --- building -----------------------------------------------------------------------------

    def add_input(self, name: str, type: TensorType, role: Role = Role.INPUT) -> Value:
        names = self._names_of_inputs()
        if name in names:
            raise ValueError(f"graph @{self.name} already has an input %{name}")
        value = Value(type, None, 0, name=name, role=Role(role))
        self.inputs.append(value)
        names.add(name)
        self._input_names = (id(self.inputs), len(self.inputs), names)
        return value

    def _names_of_inputs(self) -> set[str]:
        cached = self._input_names
        if cached is None or cached[:2] != (id(self.inputs), len(self.inputs)):
            cached = (id(self.inputs), len(self.inputs), {v.name for v in self.inputs})
            self._input_names = cached
        return cached[2]

    def add_node(self, node: Node, before: Node | None = None) -> Node:
        """Insert `node` before `before` (without it: at the insertion point, by default the
        end) and record it as a user of its operands. O(1)."""
        if node.graph is not None:
            raise ValueError(f"{node.op} is already in graph @{node.graph.name}")
        if before is not None and before not in self.nodes:
            raise ValueError(f"cannot insert before {before.op}: it is not in graph @{self.name}")
        node.graph = self
        for v in node.input_values:
            v.users[node] = None
        if before is not None:
            self.nodes.insert_before(before, node)
        elif self._insert is not None:
            self._insert(node)
        else:
            self.nodes.append(node)
        return node

    @contextmanager
    def inserting_before(self, node: Node | None) -> Iterator[None]:
        """Within the block, nodes added without `before` go in front of `node` (None: at the
        end), in the order they are added: `with graph.inserting_before(n): graph.create(...)`."""
        anchor = self.nodes._root if node is None else node
        with self._inserting(lambda new: self.nodes.insert_before(anchor, new)):
            yield

    @contextmanager
    def inserting_after(self, node: Node) -> Iterator[None]:
        """Within the block, nodes added without `before` follow `node`, in the order they are
        added (unlike torch.fx, where each new node goes right after `node`)."""
        last = node

        def insert(new: Node) -> None:
            nonlocal last
            self.nodes.insert_after(last, new)
            last = new

        with self._inserting(insert):
            yield

    @contextmanager
    def _inserting(self, insert: Callable[[Node], None]) -> Iterator[None]:
        saved, self._insert = self._insert, insert
        try:
            yield
        finally:
            self._insert = saved

    def create(
        self,
        op: str,
        inputs: Sequence[Operand],
        attrs: dict[str, Any] | None = None,
        *,
        output_types: Sequence[TensorType] | None = None,
        module: str | None = None,
        loc: str | None = None,
        before: Node | None = None,
    ) -> Node:
        """Make a node of a registered op; its output types come from the op's type rule."""
        from graphpar.ir.registry import infer_types

        attrs = dict(attrs or {})
        if output_types is None:
            output_types = infer_types(op, inputs, attrs)
        node = Node(op, inputs, output_types, attrs, module=module, loc=loc)
        return self.add_node(node, before=before)

    def add_output(
        self, value: Value, role: OutputRole = OutputRole.OUTPUT, target: str | None = None
    ) -> None:
        self.outputs.append(Output(value, OutputRole(role), target))

    # --- editing ------------------------------------------------------------------------------

    def erase(self, node: Node) -> None:
        """Remove a node whose results are unused. O(1) plus a look at the graph's outputs."""
        self.erase_all([node])

    def erase_all(self, nodes: Iterable[Node]) -> None:
        """Remove nodes, users before producers, each unused once its users are gone: O(1) per
        node (the graph's outputs are looked at once)."""
        returned = {o.value for o in self.outputs}
        for node in nodes:
            if node not in self.nodes:
                raise ValueError(f"cannot erase {node.op}: it is not in graph @{self.name}")
            for out in node.outputs:
                if out.users or out in returned:
                    raise ValueError(f"cannot erase {node.op}: its result is still used")
            for v in node.input_values:
                v.users.pop(node, None)
            self.nodes.remove(node)
            node.graph = None  # after unlinking: iterators step over nodes with no graph

    def replace_all_uses(self, old: Value, new: Value, outputs: bool = True) -> None:
        """Make every reader of `old` read `new`: its users, and with `outputs` the graph's
        outputs (a scan of them: a pass replacing many values passes False and calls
        `replace_outputs` once at the end, staying linear)."""
        for user in list(old.users):
            user.replace_input(old, new)
        if outputs:
            self.replace_outputs({old: new})

    def replace_outputs(self, replacements: dict[Value, Value]) -> None:
        """Outputs that return a replaced value return its replacement (followed through
        chains: a replaced by b, b by c gives c)."""
        if not replacements:
            return
        for out in self.outputs:
            while out.value in replacements:
                out.value = replacements[out.value]

    # --- reading ------------------------------------------------------------------------------

    def input(self, name: str) -> Value:
        for v in self.inputs:
            if v.name == name:
                return v
        raise KeyError(f"graph @{self.name} has no input %{name}")

    def inputs_by_name(self) -> dict[str, Value]:
        """The inputs by name: for looking many up (`input` scans the list each time)."""
        return {v.name: v for v in self.inputs}

    def inputs_with_role(self, *roles: Role) -> list[Value]:
        return [v for v in self.inputs if v.role in roles]

    def values(self) -> Iterator[Value]:
        yield from self.inputs
        for node in self.nodes:
            yield from node.outputs

    def find(self, op: str) -> list[Node]:
        return [n for n in self.nodes if n.op == op]

    def nodes_only_reaching(self, role: OutputRole) -> set[Node]:
        """The nodes whose results only ever reach outputs of `role`, through nodes like
        them. With UPDATE: a training step's optimizer update and the gradient work that only
        feeds it, which may wait until the whole backward has run (as DDP runs
        `optimizer.step()` after `backward()`)."""
        returned = {o.value: o.role for o in self.outputs}
        found: set[Node] = set()
        for node in reversed(self.nodes):
            if all(returned.get(v, role) is role and all(u in found for u in v.users)
                   for v in node.outputs):
                found.add(node)
        return found

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __str__(self) -> str:
        return text_form([self])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and structurally_equal(self, other)

    __hash__ = None  # type: ignore[assignment]

    def copy(self, map_type: Callable[[TensorType], TensorType] | None = None,
             map_constant: Callable[[Any], Any] | None = None) -> Graph:
        """A deep copy of the structure (types, attrs, layouts, metadata), not of tensors.

        `map_type` rewrites every value's type and `map_constant` every inline operand and
        attribute value, visited in a fixed order: the inputs' types, then per node its inline
        operands, its attributes, its results' types (graph_template relies on that order).
        """
        map_type, map_constant = map_type or _unchanged, map_constant or _unchanged
        new = Graph(self.name, attrs=dict(self.attrs), mesh=self.mesh)
        mapping: dict[Value, Value] = {}
        for v in self.inputs:  # a copy of a valid graph: names are already unique
            fresh = Value(map_type(v.type), None, 0, name=v.name, role=v.role)
            fresh.layout = v.layout
            new.inputs.append(fresh)
            mapping[v] = fresh
        copy_nodes(self.nodes, new, mapping, map_type, map_constant)
        for out in self.outputs:
            new.add_output(mapping[out.value], out.role, out.target)
        return new


def copy_nodes(nodes: Iterable[Node], into: Graph, mapping: dict[Value, Value],
               map_type: Callable[[TensorType], TensorType] | None = None,
               map_constant: Callable[[Any], Any] | None = None) -> None:
    """Append a copy of each of `nodes`, in order, to `into`: op, attributes, module, source
    line, result types and layouts. A copy reads `mapping[v]` for each value `v` its node reads
    (the values from outside `nodes` must be there), and each result is added to `mapping`.

    `map_type` rewrites the results' types and `map_constant` the inline operands and attribute
    values, per node in that order: operands, attributes, result types (as `Graph.copy` says).
    """
    map_type, map_constant = map_type or _unchanged, map_constant or _unchanged
    for node in nodes:
        operands = [mapping[v] if isinstance(v, Value) else map_constant(v)
                    for v in node.inputs]
        attrs = {k: map_constant(a) for k, a in node.attrs.items()}
        copy = Node(node.op, operands, [map_type(o.type) for o in node.outputs], attrs,
                    node.module, node.loc)
        into.add_node(copy)
        for old, fresh in zip(node.outputs, copy.outputs):
            fresh.layout = old.layout
            mapping[old] = fresh


def _unchanged(x: Any) -> Any:
    return x


def structurally_equal(a: Graph, b: Graph) -> bool:
    """Equal up to the numbering of intermediate values: what `parse(print(g)) == g` means.

    Source locations and module paths are metadata, like torch.fx's `node.meta`, and not compared.
    """
    if a.name != b.name or a.attrs != b.attrs or a.mesh != b.mesh or len(a.inputs) != len(b.inputs):
        return False
    if len(a.nodes) != len(b.nodes) or len(a.outputs) != len(b.outputs):
        return False
    mapping: dict[Value, Value] = {}
    for va, vb in zip(a.inputs, b.inputs):
        if (va.name, va.type, va.role, va.layout) != (vb.name, vb.type, vb.role, vb.layout):
            return False
        mapping[va] = vb
    for na, nb in zip(a.nodes, b.nodes):
        if na.op != nb.op or na.attrs != nb.attrs or len(na.inputs) != len(nb.inputs):
            return False
        for x, y in zip(na.inputs, nb.inputs):
            if isinstance(x, Value):
                if mapping.get(x) is not y:
                    return False
            elif isinstance(y, Value) or type(x) is not type(y) or not _same_scalar(x, y):
                return False
        if len(na.outputs) != len(nb.outputs):
            return False
        for oa, ob in zip(na.outputs, nb.outputs):
            if oa.type != ob.type or oa.layout != ob.layout:
                return False
            mapping[oa] = ob
    return all(
        mapping.get(oa.value) is ob.value and (oa.role, oa.target) == (ob.role, ob.target)
        for oa, ob in zip(a.outputs, b.outputs)
    )


def _same_scalar(x: Scalar, y: Scalar) -> bool:
    if isinstance(x, float) and x != x:  # nan
        return isinstance(y, float) and y != y
    return x == y



def text_form(graphs: Iterable[Graph]) -> str:
    """The IR text of `graphs` (what `str()` gives), written by `graphpar.ir.printer`, which
    installs itself here when it loads (the printer depends on the graph, not the reverse)."""
    if _printer is None:
        raise RuntimeError("graphpar.ir.printer is not loaded")  # graphpar.ir loads it
    return _printer(graphs)


_printer: Callable[[Iterable[Graph]], str] | None = None


def install_printer(printer: Callable[[Iterable[Graph]], str]) -> None:
    global _printer
    _printer = printer


@dataclass(eq=False)
class Program:
    """Several graphs by name: what a pass produces when it splits one graph (stages, devices)."""

    graphs: dict[str, Graph] = field(default_factory=dict)

    @classmethod
    def of(cls, graphs: Iterable[Graph]) -> Program:
        return cls({g.name: g for g in graphs})

    def __getitem__(self, name: str) -> Graph:
        return self.graphs[name]

    def __iter__(self) -> Iterator[Graph]:
        return iter(self.graphs.values())

    def __len__(self) -> int:
        return len(self.graphs)

    def __str__(self) -> str:
        return text_form(self.graphs.values())

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Program)
            and list(self.graphs) == list(other.graphs)
            and all(structurally_equal(self.graphs[k], other.graphs[k]) for k in self.graphs)
        )

    __hash__ = None  # type: ignore[assignment]
