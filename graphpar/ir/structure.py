"""Structure up to renaming: the layer a module path is in, and signatures of nodes and node sets.

What "identical layers" means wherever graphpar uses it: capture repeats a traced layer
(`graphpar.capture.repeat`), the auto-shard ILP gives the same node of identical layers one set
of variables (`graphpar.passes.autoshard.identical_layers`), and the stage DP costs layers of
one structure once (`graphpar.passes.pipeline.slice_stages`). Each compares nodes by
`node_signature`, describing operands its own way (by type, by position in the layer, by
wiring), and module paths up to the layer number (`relayered`).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from graphpar.ir.graph import Node, Role, Value

# A layer is the first numbered component of a module path or an input's name: `blocks.7.attn`
# is in layer 7 of the stack `blocks`.
_LAYER = re.compile(r"^(.*?)\.(\d+)(?=\.|$)")


@functools.lru_cache(maxsize=64)
def _layer_in(stack: str) -> re.Pattern[str]:
    return re.compile(rf"^({re.escape(stack)})\.(\d+)(?=\.|$)")


def _layer_match(path: str | None, stack: str | None) -> re.Match[str] | None:
    return (_LAYER if stack is None else _layer_in(stack)).match(path or "")


def layer_of(path: str | None, stack: str | None = None) -> tuple[str, int] | None:
    """`blocks.7.attn.qkv` -> ("blocks", 7): the stack and the layer a module path (or an input
    name) is in, or None outside numbered layers. With `stack`, only a layer of that stack
    (`model.layers.7.mlp` in `model.layers`)."""
    m = _layer_match(path, stack)
    return None if m is None else (m.group(1), int(m.group(2)))


def relayered(path: str | None, layer: int | str, stack: str | None = None) -> str | None:
    """`path` moved to another layer: `relayered("blocks.7.attn", 9)` is `blocks.9.attn`, and
    with `"*"`, `blocks.*.attn`: the name of that module in every layer. A path in no layer
    (of `stack`, when given) is returned as it is."""
    m = _layer_match(path, stack)
    if m is None:
        return path
    return f"{m.group(1)}.{layer}{path[m.end():]}"


# --- nodes --------------------------------------------------------------------------------------

def operand_type(operand: Any) -> Hashable:
    """An operand as a node's sharding strategies see it: a value's type; of an inline scalar,
    only whether it is absent."""
    return operand.type if isinstance(operand, Value) else operand is None


def node_signature(node: Node, operand: Callable[[Any], Hashable] = operand_type) -> tuple:
    """A node up to the names of its values: (op, attributes, operands, result types), each
    operand as `operand` describes it. By default operands by type: what a node's strategies
    depend on, equal for the nodes in the same place of identical layers."""
    return (node.op, tuple(sorted(node.attrs.items())), tuple(operand(v) for v in node.inputs),
            tuple(o.type for o in node.outputs))


def _signature_bytes(signature: tuple) -> bytes:
    """A `node_signature` as text to hash, the same in every process (types as the IR prints
    them)."""
    op, attrs, operands, results = signature
    return repr((op, list(attrs), list(operands), [str(t) for t in results])).encode()


# --- node sets ----------------------------------------------------------------------------------

def layer_signature(nodes: Sequence[Node]) -> str:
    """A structural hash: equal for two node sets that do the same ops on the same types wired
    the same way, so that identical layers share their cost. Values from outside are compared
    by type and role only (an activation computed elsewhere counts as an input)."""
    local: dict[Value, tuple[int, int]] = {}
    outside: dict[Value, int] = {}

    def operand(v: Any) -> Hashable:
        if not isinstance(v, Value):
            return repr(v)
        if v in local:
            return local[v]
        if v not in outside:
            outside[v] = len(outside)
        # An activation from another layer and a graph input are both just data in.
        role = Role.INPUT if v.role is None else v.role
        return ("ext", outside[v], str(v.type), role.value)

    digest = hashlib.sha256()
    for k, node in enumerate(nodes):
        digest.update(_signature_bytes(node_signature(node, operand)))
        for out in node.outputs:
            local[out] = (k, out.index)
    return digest.hexdigest()[:16]


def canonical_order(nodes: Sequence[Node]) -> list[Node]:
    """`nodes` (a topological order) in an order fixed by their structure alone, so that two
    layers doing the same ops wired the same way list them alike even where the capture
    emitted them in another order (the backward of a model's last blocks often is). Kahn's
    algorithm: of the nodes whose operands are listed, the one with the least structural
    hash (op, attributes, types and its operands' hashes) comes next, ties in the given
    order."""
    members = {node: k for k, node in enumerate(nodes)}
    shape: dict[Node, bytes] = {}

    def operand(v: Any) -> Hashable:
        if isinstance(v, Value) and v.producer in members:
            return (shape[v.producer], v.index)
        if isinstance(v, Value):
            return ("in", str(v.type), v.role and v.role.value)
        return repr(v)

    waiting = [0] * len(nodes)
    users: list[list[int]] = [[] for _ in nodes]
    for k, node in enumerate(nodes):
        for v in node.input_values:
            if v.producer in members:
                waiting[k] += 1
                users[members[v.producer]].append(k)
        shape[node] = hashlib.blake2b(_signature_bytes(node_signature(node, operand)),
                                      digest_size=8).digest()
    ready = [(shape[node], k) for k, node in enumerate(nodes) if not waiting[k]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(nodes[k])
        for u in users[k]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (shape[nodes[u]], u))
    return order
