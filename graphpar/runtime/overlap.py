"""All-reduces bucketed and overlapped with compute, as DDP does with gradients.

A training step's device program all-reduces each parameter's gradient on its own, where the
update reads it: after the whole backward, one collective per parameter, each waited for before
the next node runs. On gloo a collective costs a fixed latency (a rendezvous with the other
ranks, about 0.4 ms on loopback: `tools/bench/gloo_cluster.json`) whatever its size, so ten of
them cost ten latencies, none of them hidden by compute.

`plan_buckets` plans, once per program, which `all_reduce` nodes go together: in the order
their operands are ready (the producer's position), up to `bucket_bytes` a bucket, launched as
one collective on one flat buffer right after the last operand is produced, and waited for just
before the first node that reads one of its results. Between the launch and the wait the rank
keeps computing (the rest of the backward), so the communication overlaps it. Every rank
plans the same buckets from the same program, so they launch the same collectives in the same
order. The `Interpreter` (`graphpar.backends.interpreter`, its `buckets=`) runs the plan: it
calls the communicator's `launch_all_reduce` at each bucket's launch and the returned wait at
its wait.

Results are the unbucketed ones bit for bit: the flat buffer's elements are reduced exactly as
each tensor's own would be (an elementwise sum; `GlooCommunicator`'s deterministic mode
gathers and sums left to right in group order, its native mode lets gloo's ring add the two
halves of a 2-rank group, which is commutative, and for more ranks may add in another
order: within one rounding per element).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphpar.cost.communication import deferred_nodes
from graphpar.ir.graph import Graph, Node, Value
from graphpar.ir.registry import Trait, get_op
from graphpar.ir.spmd_ops import node_axes

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "defer_reduced", "plan_buckets"]

# about one gloo latency's worth of bytes on loopback (0.4 ms x 2 GB/s): a bucket this big
# costs twice one of nothing, a smaller one is mostly latency
DEFAULT_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class Bucket:
    """All-reduce nodes (their positions in the graph) run as one collective: launched after
    node `launch_after` (-1: before the first node), waited for before node `wait_before`
    (len(graph.nodes): at the end)."""

    members: tuple[int, ...]
    launch_after: int
    wait_before: int
    nbytes: int


def defer_reduced(graph: Graph) -> int:
    """Move the all-reduces `plan_buckets` may bucket whose results only reach the
    parameter and state updates or the loss (the gradients' all-reduces, the loss's), and
    the nodes that read them (the updates), to the end of `graph`, in their order: the
    optimizer updates after the whole backward, as DDP runs `optimizer.step()` after
    `backward()`, and the loss's all-reduce in the gradients' last bucket instead of a
    rendezvous of its own. A program
    that updates each layer's parameters as soon as its gradients are reduced leaves a bucket
    nothing to overlap with (its wait comes right after its launch); deferred, the buckets
    launch during the backward and are waited for after it. Nothing that stays reads what
    moves, so the order stays topological; every rank moves the same nodes, so collectives
    keep one order across ranks. Returns how many nodes moved."""
    nodes = list(graph.nodes)
    if any(get_op(n.op).has(Trait.WRITES_OPERAND) for n in nodes):
        return 0
    updating = deferred_nodes(graph)  # those may wait
    moved: set[Node] = set()
    for node in nodes:
        if node in updating and (_bucketable(node)
                                 or any(v.producer in moved for v in node.input_values)):
            moved.add(node)
    if len(moved) == len(nodes) or not moved:
        return 0
    for node in nodes:
        if node in moved:
            graph.nodes.remove(node)
            graph.nodes.append(node)
    return len(moved)


def _bucketable(node: Node) -> bool:
    """An all-reduce over a group of two or more, not of another all-reduce's result (which a
    bucket may deliver later than the node is: such a one runs where it is)."""
    if node.op != "all_reduce" or node.attrs.get("n", 1) < 2:
        return False
    v = node.inputs[0]
    return isinstance(v, Value) and (v.producer is None or v.producer.op != "all_reduce")


def plan_buckets(graph: Graph, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """The buckets of `graph`'s all-reduces (module docstring). Those of one bucket share
    mesh axes, reduce op and dtype. A graph that writes an operand in place gets none (an
    operand copied early might not be what the node would have read); an all-reduce of
    another's result runs where it is."""
    nodes = list(graph.nodes)
    if any(get_op(n.op).has(Trait.WRITES_OPERAND) for n in nodes):
        return []
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)

    def ready(node: Node) -> int:  # the node after which its operand exists
        v = node.inputs[0]
        return position[v.producer] if isinstance(v, Value) and v.producer is not None else -1

    def first_use(node: Node) -> int:
        return min((position[u] for u in node.outputs[0].users), default=end)

    reduces = sorted(filter(_bucketable, nodes), key=lambda n: (ready(n), position[n]))
    buckets: list[Bucket] = []
    open_: dict[tuple, list[Node]] = {}

    def close(key: tuple) -> None:
        members = open_.pop(key)
        buckets.append(Bucket(tuple(sorted(position[n] for n in members)),
                              max(ready(n) for n in members),
                              min(first_use(n) for n in members),
                              sum(n.inputs[0].type.nbytes for n in members)))

    for node in reduces:
        key = (node_axes(node), node.attrs.get("op", "sum"), node.inputs[0].type.dtype)
        group = open_.get(key)
        if group is not None:
            # joining must keep the launch before every member's own position (its operand is
            # still alive there) and before the first use of any member's result
            launch = max(ready(node), *(ready(n) for n in group))
            limit = min(min(position[n] for n in (*group, node)),
                        min(first_use(n) for n in (*group, node)))
            if launch >= limit:
                close(key)
                group = None
        if group is None:
            open_[key] = group = []
        group.append(node)
        if sum(n.inputs[0].type.nbytes for n in group) >= bucket_bytes:
            close(key)
    for key in list(open_):
        close(key)
    return sorted(buckets, key=lambda b: (b.launch_after, b.members))
