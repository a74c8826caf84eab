"""Why this plan: the nodes that cost the most under an auto-shard plan, and what forcing one of
them to another strategy costs, found by solving the same reduced ILP again with that choice
fixed (`Reduced.solve(allow=...)`, as the hand plans restrict it).

A node of a repeated layer shares one ILP variable with its copies in the identical layers
(`identical_layers.layer_key`): it is explained together with them (its costs summed over
them), and forcing it forces them all, since the ILP cannot set them apart. A node that follows
its operand (ilp.py, step 1) can take only the strategies its operand's group's choices give it.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from graphpar.cost.limits import PlanLimits
from graphpar.errors import MemoryLimitError, ShardingError
from graphpar.ir.graph import Graph, Node, Value
from graphpar.ir.printer import node_numbers
from graphpar.ir.structure import node_signature
from graphpar.passes.autoshard.identical_layers import layer_key
from graphpar.passes.autoshard.ilp import DEFAULT_SOLVER, Plan, Reduced
from graphpar.passes.autoshard.strategies import Strategy

DEFAULT_TOP = 10
DEFAULT_TRIES = 3  # alternatives re-solved per node, the cheapest with the rest of the plan kept
CHANGED_SHOWN = 20


def strategy_text(node: Node, strategy: Strategy) -> str:
    """`({S(0)}, {R}) -> {S(0)}`: the layouts the strategy reads its tensor operands in, and
    gives its results, as the IR printer writes layouts."""
    ins = ", ".join(str(lay) for v, lay in zip(node.inputs, strategy.inputs)
                    if isinstance(v, Value) and lay is not None)
    outs = ", ".join(str(lay) for lay in strategy.outputs)
    return f"({ins}) -> " + (outs if len(strategy.outputs) == 1 else f"({outs})")


def node_names(graph: Graph) -> dict[Node, str]:
    """`layers.2:linear`, the node's module and op, with `#k` (the k-th in graph order) where
    several nodes share them; `op` alone for nodes outside any module."""
    base = {n: f"{n.module}:{n.op}" if n.module else n.op for n in graph.nodes}
    count = defaultdict(int)
    for b in base.values():
        count[b] += 1
    seen: dict[str, int] = defaultdict(int)
    names = {}
    for node, b in base.items():
        seen[b] += 1
        names[node] = b if count[b] == 1 else f"{b}#{seen[b]}"
    return names


@dataclass
class Forced:
    """The plan re-solved with a node (and its copies) forced to one strategy."""

    strategy: str
    plan: Plan | None = None
    delta_seconds: float | None = None
    delta_percent: float | None = None
    changed: list[tuple[str, str, str]] = field(default_factory=list)  # (node, was, now)
    why_not: str = ""  # no plan: memory, time, or a strategy the ILP cannot give the node

    def as_dict(self) -> dict:
        plan = self.plan
        return {
            "strategy": self.strategy,
            "feasible": plan is not None,
            **({"why_not": self.why_not} if plan is None else {
                "status": plan.stats.get("status"),
                "step_seconds_estimated": plan.step_seconds,
                "compute_seconds_estimated": plan.compute_seconds,
                "communication_seconds_estimated": plan.comm_seconds,
                "memory_bytes_per_device_estimated": plan.memory_bytes,
                "delta_seconds_estimated": self.delta_seconds,
                "delta_percent": self.delta_percent,
                "nodes_changed": len(self.changed),
                "changed": [{"node": n, "was": a, "now": b}
                            for n, a, b in self.changed[:CHANGED_SHOWN]],
            }),
        }


@dataclass
class Row:
    """A node (with its copies in identical layers) and what it costs under the plan."""

    node: Node
    name: str
    number: int
    copies: list[Node]  # the node first: every node this ILP variable decides alike
    follows: bool  # its strategy is a function of its operand's group's choice
    ilp_class: int  # the ILP variable that decides it (`Reduced.class_of`)
    strategy: str
    compute_seconds: float
    resharding_seconds: float
    open_alternatives: int  # other strategies the ILP can give it
    tried: list[Forced] = field(default_factory=list)

    @property
    def cost_seconds(self) -> float:
        return self.compute_seconds + self.resharding_seconds

    @property
    def best(self) -> Forced | None:
        feasible = [f for f in self.tried if f.plan is not None]
        return min(feasible, key=lambda f: f.plan.step_seconds) if feasible else None

    def as_dict(self) -> dict:
        best = self.best
        return {
            "node": self.name, "value": f"%{self.number}", "op": self.node.op,
            "module": self.node.module, "source": self.node.loc,
            "copies": len(self.copies), "follows_operand": self.follows,
            "ilp_class": self.ilp_class,
            "strategy": self.strategy,
            "compute_seconds_estimated": self.compute_seconds,
            "resharding_seconds_estimated": self.resharding_seconds,
            "cost_seconds_estimated": self.cost_seconds,
            "open_alternatives": self.open_alternatives,
            "tried": [f.as_dict() for f in self.tried],
            "best_alternative": None if best is None else best.strategy,
        }


class Explainer:
    """Costs per node under a solved plan, and counterfactual re-solves of the same ILP."""

    def __init__(self, reduced: Reduced, plan: Plan, limits: PlanLimits,
                 solver: str = DEFAULT_SOLVER):
        self.reduced, self.plan = reduced, plan
        self.problem = problem = reduced.problem
        self.limits, self.solver = limits, solver  # each re-solve's: the plan's own
        self.graph = problem.graph
        self.names = node_names(self.graph)
        self.by_name = {name: node for node, name in self.names.items()}
        self.numbers = node_numbers(self.graph)  # as the IR printer numbers them
        self.picks = problem.picks(plan)
        self.class_picks = reduced.class_picks(self.picks)
        compute, resharding = problem.item_seconds(self.picks)
        self.compute = {n: float(compute[problem.index[n]]) for n in self.graph.nodes}
        self.resharding = {n: float(resharding[problem.index[n]]) for n in self.graph.nodes}
        self.copies = self._copies()
        self._solved: dict[tuple, Plan | str] = {}  # re-solves by (class, its choices kept)

    # --- nodes and strategies by name -----------------------------------------------------------

    def node(self, name: str) -> Node:
        """The node called `name` (`layers.2:linear`, or its value `%5`), or a ShardingError
        naming the closest names."""
        text = name.strip()
        if text.lstrip("%").isdigit():
            number = int(text.lstrip("%"))
            found = next((n for n, k in self.numbers.items() if k == number), None)
            if found is not None:
                return found
        if text in self.by_name:
            return self.by_name[text]
        close = difflib.get_close_matches(text, list(self.by_name), n=5, cutoff=0.5)
        hint = (f"closest: {', '.join(close)}" if close else
                f"nodes are named module:op, e.g. {', '.join(list(self.by_name)[:3])}")
        raise ShardingError(f"--node {name}: no such node in graph @{self.graph.name} "
                            f"({hint}; or give a value number as printed, %N)")

    def strategies(self, node: Node) -> list[Strategy]:
        return self.problem.choices[self.problem.index[node]]

    def strategy(self, node: Node, text: str) -> Strategy:
        """The strategy of `node` written `text` (spaces ignored; the result layout alone when
        only one strategy gives it), or a ShardingError listing the node's strategies."""
        want = "".join(text.split())
        texts = [(s, "".join(strategy_text(node, s).split())) for s in self.strategies(node)]
        exact = [s for s, t in texts if t == want]
        by_result = [s for s, t in texts if t.split("->")[1] == want]
        found = exact or (by_result if len(by_result) == 1 else [])
        if found:
            return found[0]
        listed = "; ".join(strategy_text(node, s) for s in (by_result or self.strategies(node)))
        what = "is the result of several" if by_result else "is not one"
        raise ShardingError(f"--strategy {text}: {what} of the strategies of node "
                            f"{self.names[node]}; they are: {listed}")

    # --- costs under the plan -------------------------------------------------------------------

    def _copies(self) -> dict[Node, list[Node]]:
        """Per node, the nodes the same ILP variable decides alike: its copies in identical
        layers (same class, same place: `layer_key`), itself first."""
        reduced, problem = self.reduced, self.problem
        groups: dict[tuple, list[Node]] = defaultdict(list)
        counters: dict[tuple, int] = defaultdict(int)
        for node in self.graph.nodes:
            sig = node_signature(node)
            counters[(node.module, sig)] += 1
            place = layer_key(node, counters[(node.module, sig)])
            i = problem.index[node]
            key = (reduced.class_of(i), place, sig) if place is not None else (node,)
            groups[key].append(node)
        return {node: group for group in groups.values() for node in group}

    def row(self, node: Node) -> Row:
        copies = self.copies[node]
        i = self.problem.index[node]
        chosen = self.picks[i]
        reachable = set(int(j) for j in self.reduced.gmap[i]) - {chosen}
        return Row(node=node, name=self.names[node], number=self.numbers[node], copies=copies,
                   follows=self.reduced.root[i] != i, ilp_class=self.reduced.class_of(i),
                   strategy=strategy_text(node, self.strategies(node)[chosen]),
                   compute_seconds=sum(self.compute[n] for n in copies),
                   resharding_seconds=sum(self.resharding[n] for n in copies),
                   open_alternatives=len(reachable))

    def costliest(self, top: int = DEFAULT_TOP) -> list[Row]:
        """The `top` nodes (one row per node and its copies) that cost the most under the plan:
        compute plus the resharding charged to them (`Problem.edge_seconds`)."""
        firsts = [n for n in self.graph.nodes if self.copies[n][0] is n]
        cost = {n: sum(self.compute[m] + self.resharding[m] for m in self.copies[n])
                for n in firsts}
        order = sorted(firsts, key=lambda n: -cost[n])  # stable: graph order among ties
        return [self.row(n) for n in order[:top]]

    # --- counterfactuals ------------------------------------------------------------------------

    def alternatives(self, node: Node) -> list[tuple[Strategy, float]]:
        """The other strategies the ILP can give `node`, each with the objective's change if
        only its variable moved (every other choice as in the plan), cheapest first."""
        reduced, i = self.reduced, self.problem.index[node]
        swap = reduced.swap_seconds(self.class_picks, reduced.class_of(i))
        best: dict[int, float] = {}
        for a, j in enumerate(reduced.gmap[i]):
            j = int(j)
            if j != self.picks[i]:
                best[j] = min(best.get(j, np.inf), float(swap[a]))
        choices = self.strategies(node)
        return [(choices[j], s) for j, s in sorted(best.items(), key=lambda t: (t[1], t[0]))]

    def force(self, node: Node, strategy: Strategy) -> Forced:
        """The plan re-solved with `node` and its copies forced to `strategy`."""
        text = strategy_text(node, strategy)
        copies = set(self.copies[node])
        want = _key(strategy)
        reduced, problem = self.reduced, self.problem
        # The class choices that give every copy `want`: nodes that follow one operand, or
        # share a variable, can be forced to the same set, and then share one re-solve.
        c = reduced.class_of(problem.index[node])
        kept = np.ones(reduced.size[c], dtype=bool)
        for n in copies:
            k = problem.index[n]
            kept &= [_key(problem.choices[k][int(j)]) == want for j in reduced.gmap[k]]
        if not kept.any():
            return Forced(text, why_not="the ILP cannot give it: the node follows its "
                                        "operand, whose choices never lead to it")
        key = (c, np.flatnonzero(kept).tobytes())
        if key not in self._solved:
            self._solved[key] = self._solve(copies, want)
        plan = self._solved[key]
        if isinstance(plan, str):
            return Forced(text, why_not=plan)
        base = self.plan.step_seconds
        delta = plan.step_seconds - base
        changed = [(self.names[n], strategy_text(n, self.plan.node_strategy[n]),
                    strategy_text(n, plan.node_strategy[n]))
                   for n in self.graph.nodes if n not in copies
                   and _key(plan.node_strategy[n]) != _key(self.plan.node_strategy[n])]
        return Forced(text, plan, delta, 100.0 * delta / base if base else None, changed)

    def _solve(self, copies: set[Node], want: tuple) -> Plan | str:
        """The plan with `copies` forced to the strategy `want`, or why there is none."""
        def allow(item, choice) -> bool | None:
            return None if item not in copies else _key(choice) == want

        try:
            return self.reduced.solve(self.limits.memory_bytes, self.limits.time_seconds,
                                      self.solver, allow=allow, name="forced")
        except MemoryLimitError:
            return "no plan with it fits the memory limit"
        except ShardingError as e:
            return str(e)

    def explain_row(self, row: Row, tries: int = DEFAULT_TRIES) -> Row:
        """`row` with its counterfactuals: the `tries` alternatives cheapest with the rest of
        the plan kept, each re-solved."""
        row.tried = [self.force(row.node, s) for s, _ in self.alternatives(row.node)[:tries]]
        return row


def _key(strategy: Strategy) -> tuple:
    return strategy.inputs, strategy.outputs


@dataclass
class Explanation:
    """A plan, the nodes that cost the most under it, and their counterfactuals."""

    plan: Plan
    rows: list[Row]
    tries: int

    def as_dict(self) -> dict:
        return {**plan_dict(self.plan), "alternatives_tried_per_node": self.tries,
                "nodes": [r.as_dict() for r in self.rows]}


def plan_dict(p: Plan) -> dict:
    """A plan's step as the ILP counts it, as report data."""
    return {
        "mesh": str(p.mesh),
        "compute_model": p.compute_model,
        "step_seconds_estimated": p.step_seconds,
        "compute_seconds_estimated": p.compute_seconds,
        "communication_seconds_estimated": p.comm_seconds,
        "objective_seconds_estimated": p.stats.get("objective_seconds"),
        "memory_bytes_per_device_estimated": p.memory_bytes,
        "solver": p.stats,
    }


def explain(reduced: Reduced, plan: Plan, limits: PlanLimits, top: int = DEFAULT_TOP,
            tries: int = DEFAULT_TRIES) -> Explanation:
    """The `top` costliest nodes of `plan` (solved on `reduced`), each with up to `tries`
    counterfactual re-solves, each within `limits` (the plan's own: its memory per device and
    its time limit per re-solve)."""
    explainer = Explainer(reduced, plan, limits)
    rows = [explainer.explain_row(r, tries) for r in explainer.costliest(top)]
    return Explanation(plan, rows, tries)
