"""Strategies: for one node on one mesh, every way to map mesh axes to its factors, with costs;
and which nodes merely follow an operand (the ILP's graph simplification)."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from graphpar.cost.compute import Roofline, op_seconds
from graphpar.ir.graph import Node, Value
from graphpar.ir.layout import Layout, Partial, Replicate, Shard
from graphpar.ir.mesh import Mesh
from graphpar.ir.printer import node_flops
from graphpar.ir.registry import Trait, get_op
from graphpar.ir.structure import node_signature
from graphpar.ir.types import TensorType
from graphpar.passes.autoshard.factors import FactorSpec, factor_spec


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: required operand layouts, result layouts, compute time."""

    axis_factors: tuple[int | None, ...]  # per mesh axis: the factor it shards, or None
    inputs: tuple[Layout | None, ...]  # per operand (None for scalars and absent operands)
    outputs: tuple[Layout, ...]
    compute_seconds: float


def replicated(mesh: Mesh) -> Layout:
    return Layout(tuple(Replicate() for _ in mesh.shape))


_CACHE: dict[tuple, list[Strategy]] = {}


def node_strategies(node: Node, mesh: Mesh, roofline: Roofline | float) -> list[Strategy]:
    """Every valid strategy, deduplicated; the all-replicated one is always first. Cached by
    `node_signature` (op, attributes, operand and result types: all a node's strategies depend
    on), so equal nodes share one (read-only) list. `roofline` prices compute
    (`graphpar.cost.compute`; a number is a peak FLOP/s with nothing else)."""
    roofline = Roofline.coerce(roofline)
    key = (node_signature(node), mesh, roofline)
    found = _CACHE.get(key)
    if found is None:
        if len(_CACHE) > 100_000:
            _CACHE.clear()
        found = _CACHE[key] = _enumerate(node, mesh, roofline)
    return found


def strategy_seconds(node: Node, mesh: Mesh, roofline: Roofline, inputs, outputs,
                     split: int = 1, flops: int | None = None) -> float:
    """Compute time of `node` on one device when its operands and results have the layouts
    `inputs` / `outputs`: the node's FLOPs divided by `split` (how many devices share its
    work) and the bytes of the shards one device reads and writes."""
    def local(t, layout):
        if layout is None or not isinstance(t, TensorType):
            return t
        return TensorType(layout.local_shape(t.shape, mesh), t.dtype)

    operands = [local(getattr(v, "type", v), lay) for v, lay in zip(node.inputs, inputs)]
    results = [local(o.type, lay) for o, lay in zip(node.outputs, outputs)]
    total = node_flops(node) if flops is None else flops
    return op_seconds(node.op, operands, results, node.attrs, roofline, total / split)


def _enumerate(node: Node, mesh: Mesh, roofline: Roofline) -> list[Strategy]:
    spec = factor_spec(node)
    flops = node_flops(node)
    full = replicated(mesh)
    inputs = tuple(full if isinstance(v, Value) else None for v in node.inputs)
    outputs = tuple(full for _ in node.outputs)
    plain = Strategy((None,) * len(mesh.shape), inputs, outputs,
                     strategy_seconds(node, mesh, roofline, inputs, outputs, 1, flops))
    if spec is None:
        return [plain]
    strategies, seen = [plain], {(plain.inputs, plain.outputs)}
    choices = [f for f in range(len(spec.sizes)) if f not in spec.blocked]
    # An axis of size 1 splits nothing: it only ever replicates.
    per_axis = [[None] if size == 1 else [None, *choices] for size in mesh.shape]
    for assignment in itertools.product(*per_axis):
        if all(f is None for f in assignment):
            continue
        strategy = _strategy(node, spec, mesh, assignment, roofline, flops)
        if strategy is not None and (strategy.inputs, strategy.outputs) not in seen:
            seen.add((strategy.inputs, strategy.outputs))
            strategies.append(strategy)
    return strategies


def _strategy(node: Node, spec: FactorSpec, mesh: Mesh, assignment, roofline: Roofline,
              flops: int) -> Strategy | None:
    for f in set(assignment) - {None}:
        ways = math.prod(mesh.shape[a] for a, g in enumerate(assignment) if g == f)
        if spec.sizes[f] % ways:
            return None
    inputs = []
    for i, v in enumerate(node.inputs):
        dims = spec.operands[i] if i < len(spec.operands) else None
        if not isinstance(v, Value):
            inputs.append(None)
            continue
        if dims is None:
            dims = (None,) * v.type.rank
        placements = []
        for f in assignment:
            if f is not None and f in dims:
                d = dims.index(f)
                placements.append(Shard(d))
            elif f is not None and f in spec.partial_operands.get(i, ()):
                placements.append(Partial("sum"))
            else:
                placements.append(Replicate())
        layout = Layout(tuple(placements))
        if not _divides(layout, v.type.shape, mesh):
            return None
        inputs.append(layout)
    outputs = []
    for r, out in enumerate(node.outputs):
        placements = []
        for f in assignment:
            if f is None:
                placements.append(Replicate())
            elif f in spec.results[r]:
                placements.append(Shard(spec.results[r].index(f)))
            elif f in spec.reductions[r]:
                placements.append(Partial(spec.reductions[r][f]))
            else:
                return None  # the result needs every shard of this factor
        layout = Layout(tuple(placements))
        if not _divides(layout, out.type.shape, mesh):
            return None
        outputs.append(layout)
    split = math.prod(mesh.shape[a] for a, f in enumerate(assignment) if f is not None)
    seconds = strategy_seconds(node, mesh, roofline, inputs, outputs, split, flops)
    return Strategy(tuple(assignment), tuple(inputs), tuple(outputs), seconds)


def _divides(layout: Layout, shape: tuple[int, ...], mesh: Mesh) -> bool:
    for d, size in enumerate(shape):
        ways = math.prod(mesh.shape[a] for a, p in enumerate(layout.placements)
                         if isinstance(p, Shard) and p.dim == d)
        if size % ways:
            return False
    return True


def input_layouts(value: Value, mesh: Mesh) -> list[Layout]:
    """Candidate layouts of a graph input: replicated first, then every even sharding."""
    return _input_layouts(value.type.shape, mesh)


@functools.lru_cache(maxsize=4096)
def _input_layouts(shape: tuple[int, ...], mesh: Mesh) -> list[Layout]:
    from graphpar.ir.layout import all_layouts

    full = replicated(mesh)
    useful = [lay for lay in all_layouts(shape, mesh) if lay != full and all(
        p.is_replicate() for p, size in zip(lay.placements, mesh.shape) if size == 1)]
    return [full] + useful


# --- graph simplification: which nodes follow an operand ----------------------------------------

def is_follower(node: Node) -> bool:
    """Cheap nodes (elementwise, shape ops, reductions, norms, softmax, losses: the ops declared
    `follows-operand`) whose layout is best decided by the operand they read: Alpa merges them
    into that operand's node. Heavy ops keep a decision of their own."""
    return get_op(node.op).has(Trait.FOLLOWS_OPERAND)


def dominant_operand(node: Node, position: dict[Node, int],
                     anchored: Callable[[Value], bool] | None = None) -> int | None:
    """The operand a follower follows: the largest, of the highest rank (never one broadcast
    against another); among equals, one `anchored` (in the ILP: derived from parameters or
    optimizer state, so optimizer updates follow the state they update), then the one produced
    last (Alpa's deepest operand; graph inputs count as produced first). None when the node
    reads no tensor."""
    best, best_key = None, None
    for i, v in enumerate(node.inputs):
        if not isinstance(v, Value):
            continue
        key = (v.type.numel, v.type.rank, anchored is not None and anchored(v),
               -1 if v.producer is None else position[v.producer])
        if best_key is None or key > best_key:
            best, best_key = i, key
    return best
