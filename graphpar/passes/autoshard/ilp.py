"""Alpa's intra-operator ILP, kept small, solved with OR-Tools.

The unsimplified problem (`Problem`) has one choice per node (its strategy) and per graph input
(its layout); the objective sums compute times and, on every edge, the resharding time from the
producer's result layout to the layout the consumer needs (Alpa's Eq. 1), under a per-device
memory limit. `Reduced` shrinks it before a solver sees it, without changing its optimum on the
graphs we measured (docs/autoshard.md):

1. Followers — elementwise ops, shape ops, norms, softmax, losses — ride on the choice of the
   operand they follow (the largest; for optimizer updates, the state they update): for each
   choice of that operand's group they take the strategy that reads it as it is. They add no
   variables; their other edges attach to the group's variable, and edges inside a group become
   per-choice constants. Nodes where following could cost keep a choice (`_may_follow`).
2. Groups in the same place of identical layers (module paths equal up to the layer index,
   equal signatures: `identical_layers.layer_key`) share ONE set of variables; edges between
   them add up, so costs inside repeated layers count with their multiplicity and the edges between
   consecutive layers become edges between the shared variables.
3. Choices no better than another choice of the same variable in every cost and in memory are
   dropped, variables left with one choice become constants, and edge pair variables are kept
   per block of equal rows and columns.
4. Without a memory limit the problem is a sum of per-class and per-edge costs, and classes are
   minimised out exactly (`chains`): all of them, when no table over a class's neighbours gets
   large (no MIP at all), else those with at most two edges, before the MIP.

What remains is Alpa's linearization (one-hot choices, pair variables per edge), solved by a
MIP solver through pywraplp (HiGHS by default; CBC, SCIP) or by CP-SAT. The plan is then costed
on the full graph, so the times it reports do not depend on the reductions.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from graphpar.cost.communication import (
    DEFERRED_ROLES,
    bucketed_resharding_seconds,
    resharding_cost_matrix,
)
from graphpar.cost.compute import Roofline
from graphpar.cost.limits import NO_MEMORY_LIMIT, PlanLimits
from graphpar.errors import MemoryLimitError, ShardingError, TimeLimitError
from graphpar.ir.graph import PERSISTENT_ROLES, Graph, Node, OutputRole, Role, Value
from graphpar.ir.layout import Layout
from graphpar.ir.mesh import Mesh
from graphpar.ir.ops import OpKind, get_op
from graphpar.ir.structure import node_signature
from graphpar.passes.autoshard.chains import eliminate, solve_exactly
from graphpar.passes.autoshard.identical_layers import input_key, layer_key
from graphpar.passes.autoshard.strategies import (
    Strategy,
    dominant_operand,
    input_layouts,
    is_follower,
    node_strategies,
    replicated,
)

OBJECTIVE_UNIT = 1e-10  # seconds per integer objective unit (CP-SAT works in integers)
MEMORY_TIEBREAK = 1.0 / (1 << 20)  # objective units per byte: ties go to the plan using less memory
DEFAULT_SOLVER = "highs"  # the fastest on our graphs (docs/autoshard.md); all: `SOLVERS`

# A hand plan's filter: (item, its choice) -> False to forbid that choice, True or None to allow.
Allow = Callable[[object, object], "bool | None"]


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
    name: str = "ilp"
    compute_model: str = ""  # what priced compute: the roofline's name ("dgx-a100 fp32")

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds

    def layout_of(self, value: Value) -> Layout:
        if value.producer is None:
            return self.input_layout[value]
        return self.node_strategy[value.producer].outputs[value.index]


class Deadline:
    """The auto-shard time limit, counted from the pass' start: building the problem (strategies,
    resharding cost tables) and solving it share it, so a limit bounds the whole pass."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.start = time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def check(self, doing: str, done: int | None = None, total: int | None = None) -> None:
        """Raise ShardingError, naming the option, if the limit has passed while `doing` (with
        `done` of `total` parts of it done, if given: the message is only built then)."""
        if self.left() <= 0:
            if done is not None:
                doing += f" ({done} of {total} done)"
            raise TimeLimitError(
                f"auto-shard ran out of its time limit of {self.seconds:g} s while {doing}, "
                "before the ILP solver started; raise --time-limit (auto-shard{time_limit=...}), "
                "or use a mesh with fewer axes (each axis multiplies the layouts and strategies "
                "to cost)")


_NO_DEADLINE = Deadline(float("inf"))

# --- the unsimplified problem -------------------------------------------------------------------

class Problem:
    """Every graph input's candidate layouts and every node's strategies on one mesh, the edges
    between them, and what each choice costs in time and memory."""

    def __init__(self, graph: Graph, mesh: Mesh, roofline: Roofline | float,
                 deadline: Deadline = _NO_DEADLINE, tables: dict | None = None,
                 bucket_bytes: float | None = None):
        """`tables`: resharding cost tables to share with other problems (per mesh, by
        shape and layouts): the layers of one model priced on the same mesh reshard the same
        activations between the same layouts. `bucket_bytes`: the program will run with
        its gradients' all-reduces in buckets of about that many bytes (a `graphpar train`
        rank: `graphpar.runtime.overlap`), so an all-reduce into the optimizer update is
        priced with its share of one bucket's latency (`bucketed_resharding_seconds`);
        None: each all-reduce on its own."""
        self.graph, self.mesh = graph, mesh
        self.bucket_bytes = bucket_bytes
        self.roofline = roofline = Roofline.coerce(roofline)
        self.deadline = deadline
        self.items: list = [*graph.inputs, *graph.nodes]
        self.index = {item: i for i, item in enumerate(self.items)}
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        self.choices: list[list] = [input_layouts(v, mesh) for v in graph.inputs]
        for node in graph.nodes:
            deadline.check("enumerating the strategies of nodes and inputs", len(self.choices),
                           len(self.items))
            self.choices.append(node_strategies(node, mesh, roofline))
        self.training = any(o.role is OutputRole.LOSS for o in graph.outputs)
        self._layouts: dict[Layout, int] = {}
        self._layout_list: list[Layout] = []
        self._tables: dict[int, tuple] = {}  # id(choice list) -> layout ids of its choices
        self._costs: dict[tuple, np.ndarray] = {}
        self._shared: dict[tuple, np.ndarray] = ({} if tables is None
                                                 else tables.setdefault(mesh, {}))
        self.compute = [self._compute(i) for i in range(len(self.items))]
        self.memory = self._memory_terms()
        self.edges = self._edges()
        self.bucketed_edges = self._bucketed_edges()

    # Layouts are interned as small ints so that edge matrices are built by array indexing.
    def layout_id(self, layout: Layout) -> int:
        found = self._layouts.get(layout)
        if found is None:
            found = self._layouts[layout] = len(self._layout_list)
            self._layout_list.append(layout)
        return found

    def table(self, i: int) -> tuple:
        """(result layout ids per output, operand layout ids per operand), each an array over
        item i's choices; for a graph input, ((its layout ids,), ())."""
        choices = self.choices[i]
        found = self._tables.get(id(choices))
        if found is None:
            if isinstance(self.items[i], Value):
                found = ((np.array([self.layout_id(x) for x in choices]),), ())
            else:
                first = choices[0]
                outs = tuple(np.array([self.layout_id(s.outputs[r]) for s in choices])
                             for r in range(len(first.outputs)))
                ins = tuple(np.array([-1 if s.inputs[k] is None else self.layout_id(s.inputs[k])
                                      for s in choices]) for k in range(len(first.inputs)))
                found = (outs, ins)
            self._tables[id(choices)] = (choices, *found)  # keep the list alive with its id
            return found
        return found[1:]

    def cost_matrix(self, value: Value, src_ids: np.ndarray, dst_ids: np.ndarray) -> np.ndarray:
        """Resharding seconds from each source layout to each destination layout of `value`
        (read-only: cached, and shared by the edges of identical layers)."""
        shape, itemsize = value.type.shape, value.type.itemsize
        key = (shape, itemsize, src_ids.tobytes(), dst_ids.tobytes())
        found = self._costs.get(key)
        if found is None:
            us, inv_s = np.unique(src_ids, return_inverse=True)
            ud, inv_d = np.unique(dst_ids, return_inverse=True)
            layouts = self._layout_list
            src = tuple(layouts[a] for a in us)
            dst = tuple(layouts[b] for b in ud)
            base = self._shared.get((shape, itemsize, src, dst))
            if base is None:
                base = np.array(resharding_cost_matrix(shape, itemsize, src, dst, self.mesh))
                self._shared[(shape, itemsize, src, dst)] = base
            found = self._costs[key] = base[np.ix_(inv_s.ravel(), inv_d.ravel())]
        return found

    def edge_matrix(self, e: int, src_ids: np.ndarray, dst_ids: np.ndarray) -> np.ndarray:
        """Resharding seconds of edge `e` from each source layout to each destination layout:
        `cost_matrix`, or for an edge whose all-reduce waits for the end of the backward in a
        program that runs such all-reduces in buckets, its bucketed price."""
        value = self.edges[e][0]
        if e not in self.bucketed_edges:
            return self.cost_matrix(value, src_ids, dst_ids)
        shape, itemsize = value.type.shape, value.type.itemsize
        key = ("bucketed", shape, itemsize, src_ids.tobytes(), dst_ids.tobytes())
        found = self._costs.get(key)
        if found is None:
            layouts = self._layout_list
            found = self._costs[key] = np.array([[
                0.0 if a == b else bucketed_resharding_seconds(
                    shape, itemsize, layouts[a], layouts[b], self.mesh, self.bucket_bytes)
                for b in dst_ids] for a in src_ids]).reshape(len(src_ids), len(dst_ids))
        return found

    def _bucketed_edges(self) -> frozenset[int]:
        """The edges whose all-reduces a bucketing runtime defers and buckets: those of a
        value every reader of which only feeds parameter and state updates, or every reader
        of which only feeds the loss, and the loss itself (`deferred_nodes`; the all-reduce is
        deferred when all of its readers are)."""
        if self.bucket_bytes is None or not self.training:
            return frozenset()
        graph = self.graph
        sets = {role: graph.nodes_only_reaching(role) for role in DEFERRED_ROLES}
        loss = {o.value for o in graph.outputs if o.role is OutputRole.LOSS}

        def waits(v: Value, roles=DEFERRED_ROLES) -> bool:
            return any(all(u in sets[r] for u in v.users) for r in roles)

        return frozenset(e for e, (v, _, dst, _) in enumerate(self.edges)
                         if (dst >= 0 and isinstance(self.items[dst], Node) and v.users
                             and waits(v))
                         or (dst < 0 and v in loss and waits(v, (OutputRole.LOSS,))))

    def produced_ids(self, value: Value) -> np.ndarray:
        """Layout ids `value` has under each choice of its producer."""
        item = self.index[value if value.producer is None else value.producer]
        return self.table(item)[0][value.index if value.producer is not None else 0]

    def _compute(self, i: int) -> np.ndarray:
        if isinstance(self.items[i], Value):
            return np.zeros(len(self.choices[i]))
        return np.array([s.compute_seconds for s in self.choices[i]])

    def _memory_terms(self) -> dict[int, np.ndarray]:
        """Bytes per choice of what lives on a device through a step: parameters (and their
        gradients in training), buffers, optimizer state, and the activations the backward
        reads."""
        graph, mesh, terms = self.graph, self.mesh, {}
        for v in graph.inputs:
            if v.role in PERSISTENT_ROLES:
                factor = 2 if (self.training and v.role is Role.PARAM) else 1
                i = self.index[v]
                terms[i] = np.array([factor * lay.local_bytes(v.type.shape, v.type.itemsize, mesh)
                                     for lay in self.choices[i]], dtype=float)
        if self.training:
            loss = next((o.value for o in graph.outputs if o.role is OutputRole.LOSS), None)
            boundary = self.position.get(loss.producer, -1) if loss is not None else -1
            for node in graph.nodes[:boundary + 1]:
                for out in node.outputs:
                    if any(self.position[u] > boundary for u in out.users):
                        i = self.index[node]
                        kept = np.array([s.outputs[out.index].local_bytes(
                            out.type.shape, out.type.itemsize, mesh) for s in self.choices[i]],
                            dtype=float)
                        terms[i] = terms[i] + kept if i in terms else kept
        return terms

    def _edges(self) -> list[tuple[Value, int, int, int]]:
        """(value, producer item, consumer item or -1 for the user, operand index or -1 when
        the consumer is a graph input whose layout the value must take)."""
        edges = []
        for node in self.graph.nodes:
            dst = self.index[node]
            for k, v in enumerate(node.inputs):
                if isinstance(v, Value):
                    edges.append((v, self._src(v), dst, k))
        state = self.graph.inputs_by_name()
        for out in self.graph.outputs:
            if out.role in (OutputRole.UPDATE, OutputRole.GRAD):  # back to the state's layout
                edges.append((out.value, self._src(out.value), self.index[state[out.target]], -1))
            else:  # the user reads whole results
                edges.append((out.value, self._src(out.value), -1, -1))
        return edges

    def _src(self, v: Value) -> int:
        return self.index[v if v.producer is None else v.producer]

    def needed_ids(self, dst: int, k: int) -> np.ndarray:
        if dst < 0:
            return np.array([self.layout_id(replicated(self.mesh))])
        outs, ins = self.table(dst)
        return outs[0] if k < 0 else ins[k]

    def edge_seconds(self, picks: list[int]):
        """(edge index, the item it is charged to, resharding seconds) of every edge that
        reshards under one choice per item. An edge is charged to the node that reads the value;
        a result the user reads, or new state written back, to the node producing it."""
        for e, (v, src, dst, k) in enumerate(self.edges):
            a = self.produced_ids(v)[picks[src]]
            b = self.needed_ids(dst, k)[0 if dst < 0 else picks[dst]]
            if a != b and b >= 0:
                charged = dst if dst >= 0 and isinstance(self.items[dst], Node) else src
                yield e, charged, float(self.edge_matrix(e, np.array([a]), np.array([b]))[0, 0])

    def evaluate(self, picks: list[int]) -> tuple[float, float, float]:
        """(compute seconds, communication seconds, memory bytes) of one choice per item, on
        the full graph."""
        compute = sum(float(c[p]) for c, p in zip(self.compute, picks))
        comm = sum((seconds for _, _, seconds in self.edge_seconds(picks)), 0.0)
        memory = sum(float(m[picks[i]]) for i, m in self.memory.items())
        return compute, comm, memory

    def item_seconds(self, picks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per item, (its compute seconds, the resharding seconds charged to it) under one
        choice per item (see `edge_seconds`): the terms `evaluate` sums."""
        compute = np.array([float(c[p]) for c, p in zip(self.compute, picks)])
        resharding = np.zeros(len(self.items))
        for _, charged, seconds in self.edge_seconds(picks):
            resharding[charged] += seconds
        return compute, resharding

    def plan(self, picks: list[int], name: str = "ilp") -> Plan:
        plan = Plan(self.mesh, {}, {}, name=name, compute_model=self.roofline.name)
        for item, choices, p in zip(self.items, self.choices, picks):
            if isinstance(item, Node):
                plan.node_strategy[item] = choices[p]
            else:
                plan.input_layout[item] = choices[p]
        compute, comm, memory = self.evaluate(picks)
        plan.compute_seconds, plan.comm_seconds, plan.memory_bytes = compute, comm, int(memory)
        return plan

    def recost(self, plan: Plan) -> Plan:
        """`plan` (made for this graph, perhaps under another cost model: a bare peak FLOP/s,
        another cluster's rates) with its times and memory as this problem prices them."""
        return self.plan(self.picks(plan), plan.name)

    def picks(self, plan: Plan) -> list[int]:
        """Per item, the index of `plan`'s choice among its choices."""
        picks = []
        for item, choices in zip(self.items, self.choices):
            if isinstance(item, Node):
                chosen = plan.node_strategy[item]
                picks.append(next(i for i, c in enumerate(choices)
                                  if (c.inputs, c.outputs) == (chosen.inputs, chosen.outputs)))
            else:
                picks.append(choices.index(plan.input_layout[item]))
        return picks


# --- the reduced problem ------------------------------------------------------------------------

def _may_follow(node: Node, operand: Value, returned: set[Value],
                anchored: Callable[[Value], bool]) -> bool:
    """Whether following `operand` loses nothing that matters. A node keeps its own choice
    when where to reshard is a real decision:

    - its result is read in several places: resharding once before the node beats resharding
      after it on every use;
    - it joins two full-size values (a residual add, an activation's backward): either side
      may be the one to reshard — unless one side is optimizer state, which updates follow;
    - it reduces its operand (a bias gradient): it can read a replicated operand sliced, for
      free, and compute only its share.
    """
    if any(len(out.users) + (out in returned) > 1 for out in node.outputs):
        return False
    if get_op(node.op).kind is OpKind.REDUCTION and any(
            out.type.numel < operand.type.numel for out in node.outputs):
        return False
    return anchored(operand) or not any(
        isinstance(w, Value) and w is not operand and w.type.numel == operand.type.numel
        and w.type.rank == operand.type.rank for w in node.inputs)


class Reduced:
    """The problem after merging followers into groups and sharing variables between identical
    layers: one variable (class) per group of equal groups, with per-choice costs and edges."""

    def __init__(self, problem: Problem, simplify: bool = True, tie_layers: bool = True):
        """`simplify`: merge followers (1.) and eliminate chains (4.); False keeps Alpa's
        problem as it is, to check the reductions against."""
        start = time.perf_counter()
        self.problem, self.simplify = problem, simplify
        n = len(problem.items)
        self.root = list(range(n))
        self.gmap = [np.arange(len(c)) for c in problem.choices]  # root choice -> own choice
        self.followers = self._merge_followers() if simplify else 0
        self.cls, self.roots = self._classes(tie_layers)
        self.size = [len(problem.choices[roots[0]]) for roots in self.roots]
        self.unary = [np.zeros(k) for k in self.size]
        self.memory = [np.zeros(k) for k in self.size]
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self._costs()
        self.build_seconds = time.perf_counter() - start

    def class_of(self, item_index: int) -> int:
        return self.cls[self.root[item_index]]

    def _merge_followers(self) -> int:
        """Point every follower at its dominant operand's group, with the strategy it takes
        under each of the group's choices. A node keeps a choice of its own where following
        could cost: see `_may_follow`."""
        p, merged, cache = self.problem, 0, {}

        def anchored(v: Value) -> bool:  # in a group led by a parameter or optimizer state
            lead = p.items[self.root[p._src(v)]]
            return isinstance(lead, Value) and lead.role in PERSISTENT_ROLES

        # Results the user reads count as uses; new state written back does not.
        returned = {o.value for o in p.graph.outputs
                    if o.role not in (OutputRole.UPDATE, OutputRole.GRAD)}
        for node in p.graph.nodes:
            d = dominant_operand(node, p.position, anchored) if is_follower(node) else None
            if d is None or not _may_follow(node, node.inputs[d], returned, anchored):
                continue
            v = node.inputs[d]
            src, i = p._src(v), p.index[node]
            layouts = p.produced_ids(v)[self.gmap[src]]
            key = (id(p.choices[i]), d, layouts.tobytes())
            if key not in cache:
                cache[key] = self._follow(i, d, layouts)
            if cache[key] is None:
                continue
            self.root[i] = self.root[src]
            self.gmap[i] = cache[key]
            merged += 1
        return merged

    def _follow(self, i: int, d: int, layouts: np.ndarray) -> np.ndarray | None:
        """Item i's strategy for each layout of its operand d: one that reads the operand as
        it is and splits no more than it (inheriting its sharding, as in Alpa), the cheapest
        such; None if some layout has none."""
        p = self.problem
        wanted = p.table(i)[1][d]
        split = np.array([sum(f is not None for f in s.axis_factors) for s in p.choices[i]])
        follow = []
        for lay in layouts:
            match = np.flatnonzero(wanted == lay)
            if match.size == 0:
                return None
            follow.append(int(match[np.lexsort((p.compute[i][match], split[match]))[0]]))
        return np.array(follow)

    def _classes(self, tie_layers: bool) -> tuple[list[int], list[list[int]]]:
        p = self.problem
        counters: dict[tuple, int] = defaultdict(int)
        by_key: dict[tuple, int] = {}
        roots: list[list[int]] = []
        cls = [-1] * len(p.items)
        for i, item in enumerate(p.items):
            if self.root[i] != i:
                continue
            key = None
            if tie_layers and isinstance(item, Node) and item.module:
                sig = node_signature(item)
                counters[(item.module, sig)] += 1
                layer = layer_key(item, counters[(item.module, sig)])
                key = None if layer is None else (layer, sig)
            elif tie_layers and isinstance(item, Value):
                name = input_key(item)
                key = None if name is None else (name, item.type, item.role)
            if key is not None and key in by_key:
                c = by_key[key]
            else:
                c = len(roots)
                roots.append([])
                if key is not None:
                    by_key[key] = c
            roots[c].append(i)
            cls[i] = c
        return cls, roots

    def _costs(self) -> None:
        p = self.problem
        for i in range(len(p.items)):
            c, g = self.class_of(i), self.gmap[i]
            self.unary[c] += p.compute[i][g]
            if i in p.memory:
                self.memory[c] += p.memory[i][g]
        for done, (v, src, dst, k) in enumerate(p.edges):
            p.deadline.check("building the resharding cost tables of edges", done,
                             len(p.edges))
            src_ids = p.produced_ids(v)[self.gmap[src]]
            if dst < 0:
                dst_ids = p.needed_ids(dst, k)
            else:
                dst_ids = p.needed_ids(dst, k)[self.gmap[dst]]
            keep = dst_ids >= 0
            if not keep.all():  # operands a strategy takes whole (never for tensors)
                continue
            matrix = p.edge_matrix(done, src_ids, dst_ids)
            if not matrix.any():
                continue
            a = self.class_of(src)
            if dst < 0:
                self.unary[a] += matrix[:, 0]
                continue
            b = self.class_of(dst)
            if a == b:  # one variable: only the diagonal can happen
                self.unary[a] += np.diag(matrix)
            elif a < b:
                self._add_edge(a, b, matrix)
            else:
                self._add_edge(b, a, matrix.T)

    def _add_edge(self, a: int, b: int, matrix: np.ndarray) -> None:
        if (a, b) in self.edges:
            self.edges[(a, b)] = self.edges[(a, b)] + matrix
        else:
            self.edges[(a, b)] = matrix.copy()

    # --- restriction (hand plans) and solving ----------------------------------------------

    def allowed(self, allow: Allow) -> list[np.ndarray]:
        """Per class, the choices under which every member item's choice passes `allow`."""
        p = self.problem
        ok = [np.ones(k, dtype=bool) for k in self.size]
        for i, item in enumerate(p.items):
            c = self.class_of(i)
            choices = p.choices[i]
            for a, j in enumerate(self.gmap[i]):
                if not ok[c][a]:
                    continue
                verdict = allow(item, choices[j])
                if verdict is False:
                    ok[c][a] = False
        return [np.flatnonzero(m) for m in ok]

    def instance(self, keep: list[np.ndarray] | None = None) -> _Instance:
        keep = keep if keep is not None else [np.arange(k) for k in self.size]
        for c, kept in enumerate(keep):
            if kept.size == 0:
                raise ShardingError(f"no allowed choice for {self._describe(c)}")
        inst = _Instance(
            keep=[k.copy() for k in keep],
            unary=[u[k] for u, k in zip(self.unary, keep)],
            memory=[m[k] for m, k in zip(self.memory, keep)],
            edges={(a, b): m[np.ix_(keep[a], keep[b])] for (a, b), m in self.edges.items()},
        )
        inst.prune()
        return inst

    def _describe(self, c: int) -> str:
        item = self.problem.items[self.roots[c][0]]
        if isinstance(item, Value):
            return f"input %{item.name}"
        return f"{item.op} in {item.module or 'the graph'}"

    def item_picks(self, class_picks: Sequence[int]) -> list[int]:
        """One choice per item (an index into its choices) from one choice per class."""
        return [int(self.gmap[i][class_picks[self.class_of(i)]])
                for i in range(len(self.problem.items))]

    def class_picks(self, picks: Sequence[int]) -> list[int]:
        """One choice per class from one choice per item (each class's first root's: a root
        follows nobody, so its choice is its class's)."""
        return [int(picks[roots[0]]) for roots in self.roots]

    def swap_seconds(self, class_picks: Sequence[int], c: int) -> np.ndarray:
        """The objective's change, in seconds, if class `c` took each of its choices and every
        other class kept its choice in `class_picks` (0 at `c`'s own choice)."""
        local = self.unary[c].copy()
        for (a, b), m in self.edges.items():
            if a == c:
                local += m[:, class_picks[b]]
            elif b == c:
                local += m[class_picks[a], :]
        return local - local[class_picks[c]]

    def solve(self, memory_limit: float | None = None, time_limit: float = 30.0,
              solver: str = DEFAULT_SOLVER, allow: Allow | None = None,
              name: str = "ilp") -> Plan:
        """The cheapest plan (restricted by `allow`), costed on the full graph."""
        if solver not in SOLVERS:
            raise ShardingError(f"unknown ILP solver {solver!r}; choose one of "
                                f"{', '.join(SOLVERS)}")
        start = time.perf_counter()
        keep = self.allowed(allow) if allow is not None else None
        inst = self.instance(keep)
        reduce_seconds = time.perf_counter() - start
        if memory_limit is not None and inst.least_memory() > memory_limit:
            raise _memory_error(self, inst, memory_limit)
        result, eliminated = _solve_instance(inst, memory_limit, time_limit, solver,
                                             self.simplify)
        if result.status not in ("OPTIMAL", "FEASIBLE"):
            if memory_limit is not None and result.status == "INFEASIBLE":
                raise _memory_error(self, inst, memory_limit)
            # UNKNOWN: the solver stopped at its limit with no plan (CP-SAT's name for it, and
            # the MIP backends' for any status but optimal, feasible and infeasible)
            error = TimeLimitError if result.status == "UNKNOWN" else ShardingError
            raise error(f"the sharding ILP found no plan ({result.status}) within the "
                        f"{time_limit:.3g} s it had; raise the time limit "
                        "(--time-limit, auto-shard{time_limit=...})")
        picks_by_class = [int(k[j]) for k, j in zip(inst.keep, result.picks)]
        plan = self.problem.plan(self.item_picks(picks_by_class), name)
        objective = inst.cost(result.picks)
        plan.stats = {
            "solver": solver,
            "status": result.status,
            "variables": result.variables,
            "constraints": result.constraints,
            "nodes": len(self.problem.graph.nodes),
            "items": len(self.problem.items),
            "followers": self.followers,
            "groups": sum(len(r) for r in self.roots),
            "classes": len(self.roots),
            "tied_layers": sum(len(r) - 1 for r in self.roots),
            "choices": sum(len(c) for c in self.problem.choices),
            "free_choices": sum(len(k) for k in inst.keep if len(k) > 1),
            "free_classes": sum(1 for k in inst.keep if len(k) > 1),
            "eliminated_classes": eliminated,
            "edges": len(inst.edges),
            "graph_edges": len(self.problem.edges),
            "build_seconds": round(self.build_seconds, 3),
            "reduce_seconds": round(reduce_seconds, 3),
            "solve_seconds": round(result.seconds, 3),
            "objective_seconds": objective,
            "optimality_gap": result.gap,
        }
        return plan


@dataclass
class _Instance:
    """What a solver sees: per class the choices still in play (indices into the class's
    choices), their costs and memory, and the edge matrices between classes."""

    keep: list[np.ndarray]
    unary: list[np.ndarray]
    memory: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]

    def free(self, c: int) -> bool:
        return len(self.keep[c]) > 1

    def least_memory(self) -> float:
        return float(sum(m.min() if m.size else 0.0 for m in self.memory))

    def cost(self, picks: list[int]) -> float:
        """The objective in seconds (without the memory tie-break)."""
        total = sum(float(u[j]) for u, j in zip(self.unary, picks))
        return total + sum(float(m[picks[a], picks[b]]) for (a, b), m in self.edges.items())

    def prune(self) -> None:
        """Fold edges at single-choice classes into their neighbours, drop dominated choices,
        until nothing changes."""
        while True:
            for (a, b), m in list(self.edges.items()):
                if not self.free(a) or not self.free(b):
                    if self.free(b):
                        self.unary[b] = self.unary[b] + m[0, :]
                    elif self.free(a):
                        self.unary[a] = self.unary[a] + m[:, 0]
                    else:
                        self.unary[a] = self.unary[a] + m[0, 0]
                    del self.edges[(a, b)]
                elif not m.any():
                    del self.edges[(a, b)]
            if not self._drop_dominated():
                return

    def _drop_dominated(self) -> bool:
        incident: dict[int, list] = defaultdict(list)
        for (a, b), m in self.edges.items():
            incident[a].append(m)
            incident[b].append(m.T)
        changed = False
        for c in range(len(self.keep)):
            if not self.free(c):
                continue
            columns = [self.unary[c][:, None], self.memory[c][:, None], *incident[c]]
            vectors = np.concatenate(columns, axis=1)
            scale = np.abs(vectors).max(axis=0, initial=0.0) * 1e-12
            le = (vectors[:, None, :] <= vectors[None, :, :] + scale).all(axis=2)  # a <= b
            eq = le & le.T
            order = np.arange(len(vectors))
            beats = le & (~eq | (order[:, None] < order[None, :]))
            np.fill_diagonal(beats, False)
            dominated = beats.any(axis=0)
            if dominated.any():
                keep = ~dominated
                self._restrict(c, keep)
                changed = True
        return changed

    def _restrict(self, c: int, mask: np.ndarray) -> None:
        self.keep[c] = self.keep[c][mask]
        self.unary[c] = self.unary[c][mask]
        self.memory[c] = self.memory[c][mask]
        for (a, b), m in list(self.edges.items()):
            if a == c:
                self.edges[(a, b)] = m[mask, :]
            elif b == c:
                self.edges[(a, b)] = m[:, mask]


def _solve_instance(inst: _Instance, memory_limit: float | None, time_limit: float,
                    solver: str, simplify: bool = True) -> tuple[_Result, int]:
    """The solver's result on `inst` (picks per class, indices into its kept choices) and how
    many free classes were minimised out before it (`chains`: exact, only without a memory
    row, when simplifying; the memory tie-break then joins each choice's cost). Where every
    class can be eliminated with small tables no MIP is built (0 variables, 0 constraints)."""
    free = [c for c in range(len(inst.keep)) if inst.free(c)]
    if simplify and memory_limit is None and free:
        tiebreak = OBJECTIVE_UNIT * MEMORY_TIEBREAK  # seconds per byte, as in the objective
        costs = {c: inst.unary[c] + inst.memory[c] * tiebreak for c in free}
        started = time.perf_counter()
        picks = solve_exactly(free, costs, inst.edges, len(inst.keep))
        if picks is not None:
            return _Result("OPTIMAL", picks, time.perf_counter() - started, 0.0, 0, 0), len(free)
        chains = eliminate(free, costs, inst.edges)
        rest = _Instance(keep=[np.arange(len(u)) for u in chains.unary], unary=chains.unary,
                         memory=[np.zeros(len(u)) for u in chains.unary], edges=chains.edges)
        result = (SOLVERS[solver](rest, None, time_limit) if rest.keep
                  else _Result("OPTIMAL", [], 0.0, 0.0, 0, 0))
        if result.status in ("OPTIMAL", "FEASIBLE"):
            result.picks = chains.picks(result.picks, len(inst.keep))
        return result, len(free) - len(chains.kept)
    if free:
        return SOLVERS[solver](inst, memory_limit, time_limit), 0
    # one choice each (and within memory, checked before): nothing to solve, and a MIP
    # solver given no variables but a memory row answers neither optimal nor not
    return _Result("OPTIMAL", [0] * len(inst.keep), 0.0, 0.0, 0, 0), 0


@dataclass
class _Result:
    status: str
    picks: list[int]
    seconds: float
    gap: float
    variables: int
    constraints: int


def _edge_blocks(m: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Alpa's pair variables per block of equal rows and equal columns rather than per entry:
    choices with the same row (e.g. the same result layout) need no pair of their own. The
    LP bound is unchanged (a transport problem between the blocks, at the same costs)."""
    row_of = np.unique(m, axis=0, return_inverse=True)[1].ravel()
    col_of = np.unique(m, axis=1, return_inverse=True)[1].ravel()
    rows = [np.flatnonzero(row_of == g) for g in range(row_of.max() + 1)]
    cols = [np.flatnonzero(col_of == h) for h in range(col_of.max() + 1)]
    return rows, cols, m[np.ix_([r[0] for r in rows], [c[0] for c in cols])]


def _objective_units(inst: _Instance, c: int) -> np.ndarray:
    return inst.unary[c] / OBJECTIVE_UNIT + inst.memory[c] * MEMORY_TIEBREAK


def _solve_cpsat(inst: _Instance, memory_limit: float | None, time_limit: float) -> _Result:
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    free = [c for c in range(len(inst.keep)) if inst.free(c)]
    x = {c: [model.NewBoolVar("") for _ in inst.keep[c]] for c in free}
    terms = []
    for c in free:
        model.AddExactlyOne(x[c])
        terms += [(int(round(w)), b) for w, b in zip(_objective_units(inst, c), x[c])]
    for (a, b), m in inst.edges.items():
        rows, cols, costs = _edge_blocks(m)
        pairs = [[model.NewBoolVar("") for _ in range(costs.shape[1])]
                 for _ in range(costs.shape[0])]
        for g, row in enumerate(pairs):
            model.Add(sum(row) == sum(x[a][j] for j in rows[g]))
        for h in range(costs.shape[1]):
            model.Add(sum(row[h] for row in pairs) == sum(x[b][k] for k in cols[h]))
        units = np.rint(costs / OBJECTIVE_UNIT).astype(np.int64)
        terms += [(int(units[g, h]), pairs[g][h]) for g in range(costs.shape[0])
                  for h in range(costs.shape[1]) if units[g, h]]
    if memory_limit is not None:
        fixed = sum(float(inst.memory[c][0]) for c in range(len(inst.keep)) if not inst.free(c))
        model.Add(sum(int(w) * b for c in free for w, b in zip(inst.memory[c], x[c]))
                  <= int(memory_limit - fixed))
    model.Minimize(sum(w * b for w, b in terms if w))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    # A portfolio of workers, interleaved so that the same graph always gives the same plan.
    solver.parameters.num_workers = 8
    solver.parameters.interleave_search = True
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    name = solver.StatusName(status)
    picks = [0] * len(inst.keep)
    gap = float("nan")
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for c in free:
            picks[c] = next(j for j, b in enumerate(x[c]) if solver.Value(b))
        value, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
        gap = 0.0 if value == 0 else abs(value - bound) / abs(value)
    proto = model.Proto()
    return _Result(name, picks, solver.WallTime(), round(gap, 6), len(proto.variables),
                   len(proto.constraints))


def _solve_mip(backend: str) -> Callable:
    def solve(inst: _Instance, memory_limit: float | None, time_limit: float) -> _Result:
        from ortools.linear_solver import pywraplp

        solver = pywraplp.Solver.CreateSolver(backend)
        if solver is None:
            raise ShardingError(f"OR-Tools was built without the {backend} solver")
        solver.SuppressOutput()
        solver.SetTimeLimit(int(time_limit * 1000))
        if backend == "HIGHS":
            solver.SetSolverSpecificParametersAsString("output_flag = false\n")
        infinity = solver.infinity()
        free = [c for c in range(len(inst.keep)) if inst.free(c)]
        x = {c: [solver.BoolVar("") for _ in inst.keep[c]] for c in free}
        objective = solver.Objective()
        for c in free:
            _row(solver, 1.0, x[c], ())
            for w, b in zip(_objective_units(inst, c), x[c]):
                objective.SetCoefficient(b, float(w))
        for (a, b), m in inst.edges.items():
            rows, cols, costs = _edge_blocks(m)
            # Pair variables may be continuous: with one-hot ends they can only be 0 or 1.
            pairs = [[solver.NumVar(0.0, 1.0, "") for _ in range(costs.shape[1])]
                     for _ in range(costs.shape[0])]
            for g, row in enumerate(pairs):
                _row(solver, 0.0, row, [x[a][j] for j in rows[g]])
            for h in range(costs.shape[1]):
                _row(solver, 0.0, [row[h] for row in pairs], [x[b][k] for k in cols[h]])
            units = costs / OBJECTIVE_UNIT
            for g in range(costs.shape[0]):
                for h in range(costs.shape[1]):
                    if units[g, h]:
                        objective.SetCoefficient(pairs[g][h], float(units[g, h]))
        if memory_limit is not None:
            fixed = sum(float(inst.memory[c][0]) for c in range(len(inst.keep))
                        if not inst.free(c))
            row = solver.Constraint(-infinity, float(memory_limit - fixed))
            for c in free:
                for w, b in zip(inst.memory[c], x[c]):
                    row.SetCoefficient(b, float(w))
        objective.SetMinimization()
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, 0.0)  # optimal, not within 1e-4
        started = time.perf_counter()
        status = solver.Solve(params)
        seconds = time.perf_counter() - started
        names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
                 pywraplp.Solver.INFEASIBLE: "INFEASIBLE"}
        name = names.get(status, "UNKNOWN")
        picks = [0] * len(inst.keep)
        gap = float("nan")
        if name in ("OPTIMAL", "FEASIBLE"):
            for c in free:
                picks[c] = int(np.argmax([b.solution_value() for b in x[c]]))
            value, bound = objective.Value(), objective.BestBound()
            gap = 0.0 if name == "OPTIMAL" or value == 0 else abs(value - bound) / abs(value)
        return _Result(name, picks, seconds, round(gap, 6), solver.NumVariables(),
                       solver.NumConstraints())
    return solve


def _row(solver, rhs: float, plus: Sequence, minus: Sequence) -> None:
    """The constraint `sum(plus) - sum(minus) == rhs`, set coefficient by coefficient: what
    `solver.Add(solver.Sum(plus) == solver.Sum(minus) + rhs)` makes, in the same order, without
    building and walking an expression tree per row (most of the model's build time)."""
    row = solver.RowConstraint(rhs, rhs, "")
    for v in plus:
        row.SetCoefficient(v, 1.0)
    for v in minus:
        row.SetCoefficient(v, -1.0)


# The solvers by name: `Reduced.solve(solver=...)`, `graphpar.passes.autoshard.explain`.
SOLVERS: dict[str, Callable] = {"cp-sat": _solve_cpsat, "scip": _solve_mip("SCIP"),
                                "cbc": _solve_mip("CBC"), "highs": _solve_mip("HIGHS")}


def solve(graph: Graph, mesh: Mesh, roofline: Roofline | float,
          limits: PlanLimits = NO_MEMORY_LIMIT, *, tie_layers: bool = True, simplify: bool = True,
          solver: str = DEFAULT_SOLVER, deadline: Deadline | None = None,
          bucket_bytes: float | None = None) -> tuple[Reduced, Plan]:
    """The reduced problem of `graph` on `mesh` (see the module docstring) and its cheapest
    plan within `limits.memory_bytes` per device (None: no limit). `limits.time_seconds`
    bounds the whole call, or `deadline` (a limit started earlier, by the pass) if given: what
    building the problem leaves of it is the solver's. The `auto-shard` pass solves through
    here, and so does every stage's re-solve on its sub-mesh. `bucket_bytes`: see
    `Problem`."""
    deadline = deadline or Deadline(limits.time_seconds)
    reduced = build_reduced(graph, mesh, roofline, deadline, tie_layers, simplify, bucket_bytes)
    return reduced, reduced.solve(limits.memory_bytes, max(deadline.left(), 1e-3), solver)


def build_reduced(graph: Graph, mesh: Mesh, roofline: Roofline | float, deadline: Deadline,
                  tie_layers: bool = True, simplify: bool = True,
                  bucket_bytes: float | None = None) -> Reduced:
    """The reduced problem `solve` solves, built within `deadline`."""
    reduced = Reduced(Problem(graph, mesh, roofline, deadline, bucket_bytes=bucket_bytes),
                      simplify=simplify, tie_layers=tie_layers)
    deadline.check("reducing the problem")
    return reduced


def _memory_error(reduced: Reduced, inst: _Instance, limit: float) -> MemoryLimitError:
    from graphpar.units import format_bytes

    problem = reduced.problem
    least = inst.least_memory()
    biggest = sorted(((float(per.min()), problem.items[i]) for i, per in problem.memory.items()),
                     key=lambda t: -t[0])[:3]
    names = ", ".join(f"{getattr(item, 'name', None) or item.op} ({format_bytes(b)})"
                      for b, item in biggest)
    return MemoryLimitError(
        f"no plan fits {format_bytes(limit)} per device on mesh {problem.mesh}: even sharding "
        f"everything as far as it goes needs about {format_bytes(least)} per device; the "
        f"largest tensors are {names}. Use more devices, a cluster with more memory per device "
        "(--cluster dgx-a100-80gb), a larger --memory-limit (or none), or a smaller batch.")
