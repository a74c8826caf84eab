"""Alpa's intra-operator ILP, solved with OR-Tools CP-SAT.

One integer choice per node (its strategy) and per graph input (its layout). The objective
sums each node's compute time and, on every edge, the resharding time from the producer's
result layout to the layout the consumer's strategy needs (table lookups, so an edge costs
one constraint however many strategies its ends have). Per-device memory — parameters,
gradients, optimizer state and the activations kept for the backward — stays under a limit.
Identical layers (same module path up to the layer index) are tied to one solution.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from graphpar.cost.collectives import resharding_cost
from graphpar.errors import MemoryLimitError, ShardingError
from graphpar.ir.graph import Graph, Node, OutputRole, Role, Value
from graphpar.ir.layout import Layout
from graphpar.ir.mesh import Mesh
from graphpar.passes.autoshard.strategies import (
    Strategy,
    input_layouts,
    node_strategies,
    replicated,
)

TIME_UNIT = 1e-9  # the solver works in integer nanoseconds
PERSISTENT = (Role.PARAM, Role.BUFFER, Role.OPTIM_STATE)


@dataclass
class Plan:
    """The solution: a strategy per node, a layout per input, and what it costs (estimated)."""

    mesh: Mesh
    node_strategy: dict[Node, Strategy]
    input_layout: dict[Value, Layout]
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    memory_bytes: int = 0
    stats: dict = field(default_factory=dict)

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds

    def layout_of(self, value: Value) -> Layout:
        if value.producer is None:
            return self.input_layout[value]
        return self.node_strategy[value.producer].outputs[value.index]


def _layer_key(node: Node, index_in_module: int) -> str | None:
    """`blocks.*.attn#3`: equal for the same node of two identical layers."""
    if not node.module or not re.search(r"\.\d+(\.|$)", node.module):
        return None
    return re.sub(r"\.\d+(?=\.|$)", ".*", node.module, count=1) + f"#{index_in_module}"


class _Problem:
    def __init__(self, graph: Graph, mesh: Mesh, peak_flops: float):
        self.graph, self.mesh = graph, mesh
        self.items: list = []  # Values (graph inputs) and Nodes
        self.choices: list[list] = []  # per item: strategies (nodes) or layouts (inputs)
        self.index: dict = {}
        for v in graph.inputs:
            self._add(v, input_layouts(v, mesh))
        for node in graph.nodes:
            self._add(node, node_strategies(node, mesh, peak_flops))

    def _add(self, item, choices) -> None:
        self.index[item] = len(self.items)
        self.items.append(item)
        self.choices.append(choices)

    def produced(self, value: Value) -> list[Layout]:
        """The layout `value` has under each choice of its producer."""
        if value.producer is None:
            return self.choices[self.index[value]]
        return [s.outputs[value.index] for s in self.choices[self.index[value.producer]]]

    def producer_item(self, value: Value):
        return value if value.producer is None else value.producer


@dataclass
class _Edge:
    value: Value
    src: int  # item index of the producer
    dst: int | None  # item index of the consumer, or None for a fixed target layout
    matrix: list[list[float]]  # seconds, [producer choice][consumer choice]


def _cost_matrix(value: Value, srcs: list[Layout], dsts: list[Layout], mesh: Mesh
                 ) -> list[list[float]]:
    cache: dict[tuple[Layout, Layout], float] = {}
    shape, itemsize = value.type.shape, value.type.itemsize

    def cost(a: Layout, b: Layout) -> float:
        if a == b:
            return 0.0
        if (a, b) not in cache:
            cache[(a, b)] = resharding_cost(shape, itemsize, a, b, mesh).seconds
        return cache[(a, b)]

    return [[cost(a, b) for b in dsts] for a in srcs]


def build_edges(problem: _Problem) -> list[_Edge]:
    graph, mesh = problem.graph, problem.mesh
    edges = []
    for node in graph.nodes:
        dst = problem.index[node]
        for i, v in enumerate(node.inputs):
            if not isinstance(v, Value):
                continue
            needed = [s.inputs[i] for s in problem.choices[dst]]
            src = problem.index[problem.producer_item(v)]
            edges.append(_Edge(v, src, dst, _cost_matrix(v, problem.produced(v), needed, mesh)))
    full = replicated(mesh)
    for out in graph.outputs:
        v = out.value
        src = problem.index[problem.producer_item(v)]
        if out.role in (OutputRole.UPDATE, OutputRole.GRAD):  # back to the state's own layout
            target = graph.input(out.target)
            dst = problem.index[target]
            matrix = _cost_matrix(v, problem.produced(v), problem.choices[dst], mesh)
            edges.append(_Edge(v, src, dst, matrix))
        else:  # the user reads whole results
            matrix = _cost_matrix(v, problem.produced(v), [full], mesh)
            edges.append(_Edge(v, src, None, matrix))
    return edges


def _memory_terms(problem: _Problem, training: bool) -> list[tuple[int, list[int]]]:
    # Persistent state always counts; activations kept for the backward count in training.
    """(item, bytes per choice) for what lives on a device through a step."""
    graph, mesh = problem.graph, problem.mesh
    terms = []
    for v in graph.inputs:
        if v.role in PERSISTENT:
            factor = 2 if (training and v.role is Role.PARAM) else 1  # + its gradient
            terms.append((problem.index[v], [
                factor * lay.local_bytes(v.type.shape, v.type.itemsize, mesh)
                for lay in problem.choices[problem.index[v]]]))
    if training:
        position = {n: i for i, n in enumerate(graph.nodes)}
        loss = next((o.value for o in graph.outputs if o.role is OutputRole.LOSS), None)
        boundary = position.get(loss.producer, -1) if loss is not None else -1
        for node in graph.nodes[:boundary + 1]:
            for out in node.outputs:
                if any(position[u] > boundary for u in out.users):  # kept for the backward
                    terms.append((problem.index[node], [
                        s.outputs[out.index].local_bytes(out.type.shape, out.type.itemsize, mesh)
                        for s in problem.choices[problem.index[node]]]))
    return terms


def solve(graph: Graph, mesh: Mesh, peak_flops: float, memory_limit: float | None = None,
          time_limit: float = 30.0, tie_layers: bool = True) -> Plan:
    """The cheapest plan for `graph` on `mesh` (see the module docstring)."""
    start = time.perf_counter()
    problem = _Problem(graph, mesh, peak_flops)
    edges = build_edges(problem)
    training = any(o.role is OutputRole.LOSS for o in graph.outputs)
    memory = _memory_terms(problem, training)
    build_seconds = time.perf_counter() - start

    model = cp_model.CpModel()
    # One-hot choices with linearized edge products (Alpa's formulation): a tight LP bound.
    onehot = [[model.NewBoolVar("") for _ in c] for c in problem.choices]
    for bits in onehot:
        model.AddExactlyOne(bits)
    objective = []
    for i, item in enumerate(problem.items):
        if isinstance(item, Node):
            objective += [_ns(s.compute_seconds) * b for s, b in zip(problem.choices[i], onehot[i])]
    for e in edges:
        if e.dst is None:
            objective += [_ns(row[0]) * b for row, b in zip(e.matrix, onehot[e.src])]
        elif any(any(row) for row in e.matrix):
            objective += _edge_terms(model, e.matrix, onehot[e.src], onehot[e.dst])
    # Tie-break toward less memory (1 ns per MB): free choices store state sharded.
    objective += [(per[k] >> 20) * b for i, per in memory for k, b in enumerate(onehot[i])]
    tied = _tie_layers(problem, model, onehot) if tie_layers else 0
    if memory_limit is not None:
        model.Add(sum(b * per[k] for i, per in memory for k, b in enumerate(onehot[i]))
                  <= int(memory_limit))
    model.Minimize(sum(objective))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    # A portfolio of workers (the LP-based ones prove these quickly), interleaved so that the
    # same graph always gives the same plan.
    solver.parameters.num_workers = 8
    solver.parameters.interleave_search = True
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if memory_limit is not None and status == cp_model.INFEASIBLE:
            raise _memory_error(problem, memory, memory_limit)
        raise ShardingError(f"the sharding ILP found no plan ({solver.StatusName(status)}) "
                            f"within {time_limit} s; raise the time limit")
    picked = [next(k for k, b in enumerate(bits) if solver.Value(b)) for bits in onehot]
    plan = Plan(mesh, {}, {})
    for i, item in enumerate(problem.items):
        if isinstance(item, Node):
            plan.node_strategy[item] = problem.choices[i][picked[i]]
        else:
            plan.input_layout[item] = problem.choices[i][picked[i]]
    plan.compute_seconds = sum(s.compute_seconds for s in plan.node_strategy.values())
    plan.comm_seconds = sum(e.matrix[picked[e.src]][0 if e.dst is None else picked[e.dst]]
                            for e in edges)
    plan.memory_bytes = sum(per[picked[i]] for i, per in memory)
    objective_value, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
    plan.stats = {
        "status": solver.StatusName(status),
        "variables": len(model.Proto().variables),
        "constraints": len(model.Proto().constraints),
        "choices": sum(len(c) for c in problem.choices),
        "edges": len(edges),
        "tied_layers": tied,
        "build_seconds": round(build_seconds, 3),
        "solve_seconds": round(solver.WallTime(), 3),
        "optimality_gap": 0.0 if objective_value == 0 else
        round(abs(objective_value - bound) / abs(objective_value), 6),
    }
    return plan


def _ns(seconds: float) -> int:
    return int(round(seconds / TIME_UNIT))


def _edge_terms(model: cp_model.CpModel, matrix, src_bits, dst_bits) -> list:
    """Cost terms of one edge, linearized as in Alpa: e_jk = src_j AND dst_k through
    sum_k e_jk = src_j and sum_j e_jk = dst_k, which keeps the LP relaxation tight."""
    pairs = [[model.NewBoolVar("") for _ in row] for row in matrix]
    for j, row in enumerate(pairs):
        model.Add(sum(row) == src_bits[j])
    for k in range(len(matrix[0])):
        model.Add(sum(row[k] for row in pairs) == dst_bits[k])
    return [_ns(cost) * pairs[j][k] for j, row in enumerate(matrix)
            for k, cost in enumerate(row) if cost]


def _tie_layers(problem: _Problem, model: cp_model.CpModel, onehot) -> int:
    """Nodes in the same place of identical layers take the same strategy."""
    counters: dict[str, int] = defaultdict(int)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, item in enumerate(problem.items):
        if not isinstance(item, Node) or not item.module:
            continue
        key = _layer_key(item, counters[item.module])
        counters[item.module] += 1
        if key is not None:
            groups[key].append(i)
    tied = 0
    for members in groups.values():
        first = members[0]
        for other in members[1:]:
            if problem.choices[other] == problem.choices[first]:
                for a, b in zip(onehot[other], onehot[first]):
                    model.Add(a == b)
                tied += 1
    return tied


def _memory_error(problem: _Problem, memory, limit: float) -> MemoryLimitError:
    from graphpar.cost.units import format_bytes

    least = sum(min(per) for _, per in memory)
    biggest = sorted(((min(per), problem.items[i]) for i, per in memory),
                     key=lambda t: -t[0])[:3]
    names = ", ".join(f"{getattr(item, 'name', None) or item.op} ({format_bytes(b)})"
                      for b, item in biggest)
    return MemoryLimitError(
        f"no plan fits {format_bytes(limit)} per device on mesh {problem.mesh}: even sharding "
        f"everything as far as it goes needs about {format_bytes(least)} per device; the "
        f"largest tensors are {names}. Use more devices, a larger --memory-limit, or a "
        "smaller batch.")
