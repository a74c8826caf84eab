"""Pipeline schedules as data: per-stage action lists (GPipe, 1F1B, ZB-H1), their validator,
a dry-run simulator and a Chrome-trace writer.

A schedule says, for every pipeline stage, the static list of actions that each rank of the
stage's sub-mesh executes in order: forward and backward work on microbatches, the blocking
sends and receives that move activations and gradients between neighbouring stages, and the
optimizer update at the end. The lists are generated ahead of time, proven complete and
deadlock-free by `validate`, and priced by `simulate` before any process starts.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from graphpar.errors import OutputError, ScheduleError


class ActionKind(enum.Enum):
    """What one action of a stage's list does."""

    F = "F"  # forward of a microbatch
    B = "B"  # the whole backward of a microbatch (input and weight gradients)
    I = "I"  # noqa: E741 - backward, input-gradient part: what the previous stage waits for
    W = "W"  # backward, weight-gradient part: nobody waits for it, so it can fill bubbles
    SEND_F = "SEND_F"  # activations to the next stage
    RECV_F = "RECV_F"  # activations from the previous stage
    SEND_B = "SEND_B"  # gradients to the previous stage
    RECV_B = "RECV_B"  # gradients from the next stage
    UPDATE = "UPDATE"  # the optimizer step, after the last microbatch's gradients


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
SEND_KINDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
RECV_KINDS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
# the backward actions whose result (the input gradient) the previous stage receives
INPUT_GRAD_KINDS = frozenset({ActionKind.B, ActionKind.I})


@dataclass(frozen=True)
class Action:
    """One step of a stage's list: `kind` on microbatch `microbatch` (None for UPDATE)."""

    kind: ActionKind
    stage: int
    microbatch: int | None

    @property
    def peer(self) -> int | None:
        """The stage a SEND goes to or a RECV comes from; None for other actions."""
        if self.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
            return self.stage + 1
        if self.kind in (ActionKind.RECV_F, ActionKind.SEND_B):
            return self.stage - 1
        return None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.kind.value}{mb}"

    def describe(self) -> str:
        """`str` with the stage, for messages: 'stage 1 SEND_F3'."""
        return f"stage {self.stage} {self}"


Schedule = dict[int, list[Action]]  # stage -> its static instruction list


# ---------------------------------------------------------------------------------------------
# Generators: each writes the compute order of every stage; `_with_communication` then places
# the sends and receives, and every list ends with the UPDATE.


def _check_sizes(name: str, stages: int, microbatches: int, needs_full_pipeline: bool) -> None:
    if stages < 1 or microbatches < 1:
        raise ScheduleError(
            f"schedule {name!r}: needs at least one stage and one microbatch, got "
            f"{stages} stage(s) and {microbatches} microbatch(es)"
        )
    if needs_full_pipeline and microbatches < stages:
        raise ScheduleError(
            f"schedule {name!r} needs at least as many microbatches as stages, got "
            f"{microbatches} microbatch(es) for {stages} stages: with fewer, its warm-up never "
            f"reaches the one-forward-one-backward steady state. Use {stages} or more "
            f"microbatches, or the 'gpipe' schedule"
        )


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards.

    Peak activations per stage: all `microbatches`. Bubble fraction (p-1)/(m+p-1)."""
    _check_sizes("gpipe", stages, microbatches, needs_full_pipeline=False)
    orders = {
        s: [Action(ActionKind.F, s, m) for m in range(microbatches)]
        + [Action(ActionKind.B, s, m) for m in range(microbatches)]
        for s in range(stages)
    }
    return _with_communication(orders)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """Synchronous 1F1B (PipeDream-flush): stage s runs p-1-s warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards.

    Same bubble as GPipe, (p-1)/(m+p-1), but stage s holds at most p-s microbatches'
    activations instead of m."""
    _check_sizes("1f1b", stages, microbatches, needs_full_pipeline=True)
    orders = {}
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        order = [Action(ActionKind.F, s, m) for m in range(warmup)]
        for k in range(microbatches - warmup):
            order += [Action(ActionKind.F, s, warmup + k), Action(ActionKind.B, s, k)]
        order += [Action(ActionKind.B, s, m) for m in range(microbatches - warmup, microbatches)]
        orders[s] = order
    return _with_communication(orders)


def zero_bubble_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 ("Zero Bubble Pipeline Parallelism", Qi et al., ICLR 2024): 1F1B with each
    backward split into I (input gradient, which the previous stage waits for) and W (weight
    gradient, which nobody waits for).

    Stage s keeps the 1F1B warm-up and runs I where 1F1B runs B, but holds back its W's by s
    microbatches: late stages send gradients upstream sooner, and the held-back W's fill the
    idle time of the drain. With W about as long as I the bubble shrinks from (p-1)(F+I+W) to
    about (p-1)(F+I-W). A microbatch's activations live from its F to its W, so every stage
    holds at most p of them: the first stage's 1F1B peak, which bounds the pipeline's memory."""
    _check_sizes("zb", stages, microbatches, needs_full_pipeline=True)
    orders = {}
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        order = [Action(ActionKind.F, s, m) for m in range(warmup)]
        next_w = 0  # the oldest microbatch whose W has not run
        for k in range(microbatches):
            if warmup + k < microbatches:
                order.append(Action(ActionKind.F, s, warmup + k))
            order.append(Action(ActionKind.I, s, k))
            if k + 1 - next_w > s:  # more than s weight gradients held back: run the oldest
                order.append(Action(ActionKind.W, s, next_w))
                next_w += 1
        order += [Action(ActionKind.W, s, m) for m in range(next_w, microbatches)]
        orders[s] = order
    return _with_communication(orders)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb": zero_bubble_h1,
}


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule called `name` (a key of SCHEDULES), validated."""
    if name not in SCHEDULES:
        raise ScheduleError(
            f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
        )
    schedule = SCHEDULES[name](stages, microbatches)
    validate(schedule)
    return schedule


# unit costs used only to order communication; any positive costs give a valid order
_ORDERING_COST = {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.I: 1.0, ActionKind.W: 1.0}


def _with_communication(orders: dict[int, list[Action]]) -> Schedule:
    """Insert the SEND/RECV actions into per-stage compute orders and end each with UPDATE.

    Sends and receives block until both sides meet, so two stages must meet their transfers in
    the same order. We time the compute orders with unit costs, give each transfer the time
    its data is ready, and put every stage's transfers in that one global order: the earliest
    pending transfer always has both sides able to reach it, so the lists never deadlock. A
    send goes right after the action that produced its data; a receive waits until the action
    that needs it (or until a later transfer of the global order must happen)."""
    stages = len(orders)
    finish = _unit_finish_times(orders)
    transfers = []  # (ready time, tie-break, sender action, receiver action)
    for s, order in orders.items():
        for a in order:
            if a.kind == ActionKind.F and s + 1 < stages:
                send, recv = ActionKind.SEND_F, ActionKind.RECV_F
                peer = s + 1
            elif a.kind in INPUT_GRAD_KINDS and s > 0:
                send, recv = ActionKind.SEND_B, ActionKind.RECV_B
                peer = s - 1
            else:
                continue
            key = (finish[a], s, a.kind.value, a.microbatch)
            mb = a.microbatch
            transfers.append((key, a, Action(send, s, mb), Action(recv, peer, mb)))
    transfers.sort(key=lambda t: t[0])

    pending: dict[int, list[tuple[Action, float]]] = {s: [] for s in orders}
    for (ready, *_), _producer, send, recv in transfers:
        pending[send.stage].append((send, ready))
        pending[recv.stage].append((recv, ready))

    schedule: Schedule = {}
    for s, order in orders.items():
        queue = pending[s]
        needed = {
            (a.kind, a.microbatch): i for i, (a, _) in enumerate(queue) if a.kind in RECV_KINDS
        }
        out: list[Action] = []
        head = 0
        for a in order:
            recv_kind = ActionKind.RECV_F if a.kind == ActionKind.F else ActionKind.RECV_B
            last = needed.get((recv_kind, a.microbatch), -1) if a.kind != ActionKind.W else -1
            while head <= last:  # receive lazily: up to the transfer this action needs
                out.append(queue[head][0])
                head += 1
            out.append(a)
            # then every transfer that is ready by the time `a` finishes: the sends of what this
            # stage has computed, and receives of data already there
            while head < len(queue) and queue[head][1] <= finish[a]:
                out.append(queue[head][0])
                head += 1
        out += [t for t, _ in queue[head:]]
        out.append(Action(ActionKind.UPDATE, s, None))
        schedule[s] = out
    return schedule


def _unit_finish_times(orders: dict[int, list[Action]]) -> dict[Action, float]:
    """Finish time of every compute action with `_ORDERING_COST`, data dependencies between
    neighbouring stages and each stage's list order."""
    stages = len(orders)
    input_grad = {
        (a.stage, a.microbatch): a
        for order in orders.values()
        for a in order
        if a.kind in INPUT_GRAD_KINDS
    }
    finish: dict[Action, float] = {}
    position = dict.fromkeys(orders, 0)
    clock = dict.fromkeys(orders, 0.0)
    progress = True
    while progress:
        progress = False
        for s, order in orders.items():
            while position[s] < len(order):
                a = order[position[s]]
                if a.kind == ActionKind.F and s > 0:
                    dep = Action(ActionKind.F, s - 1, a.microbatch)
                elif a.kind in INPUT_GRAD_KINDS and s + 1 < stages:
                    dep = input_grad.get((s + 1, a.microbatch))
                else:
                    dep = None
                if dep is not None and dep not in finish:
                    break
                start = max(clock[s], finish.get(dep, 0.0))
                clock[s] = finish[a] = start + _ORDERING_COST[a.kind]
                position[s] += 1
                progress = True
    stuck = [order[position[s]] for s, order in orders.items() if position[s] < len(order)]
    if stuck:
        raise ScheduleError(
            "pipeline schedule cannot make progress: "
            + ", ".join(a.describe() for a in stuck)
            + " each wait for data that is never produced"
        )
    return finish


# ---------------------------------------------------------------------------------------------
# The validator


def validate(schedule: Schedule) -> None:
    """Prove `schedule` complete and deadlock-free, or raise ScheduleError naming the stage
    and action at fault.

    Complete: on every stage every microbatch has exactly one F and either one B or one I and
    one W, in that order; a stage receives a microbatch's activations before its F and its
    gradient before its B/I, and sends what it produced after producing it; every SEND has
    exactly one RECV of the same tensor on the peer stage; UPDATE comes once, last.
    Deadlock-free: a SEND and its RECV block until both sides reach them, so each waits for
    the other side's previous action; with each stage's list order this is the
    happens-before graph, and it must have no cycle."""
    stages = _check_lists(schedule)
    microbatches = 1 + max(
        (a.microbatch for order in schedule.values() for a in order if a.microbatch is not None),
        default=-1,
    )
    if microbatches == 0:
        raise ScheduleError("pipeline schedule has no microbatch work on any stage")
    checks = [_StageCheck(schedule[s], s, stages, microbatches) for s in range(stages)]
    for check in checks:
        check.compute()
    _check_transfers(stages, microbatches, [check.positions for check in checks])
    for check in checks:
        check.transfers()
    graph = happens_before(schedule)
    if not nx.is_directed_acyclic_graph(graph):  # cheaper than find_cycle on valid schedules
        raise ScheduleError(_describe_cycle(schedule, graph, nx.find_cycle(graph)))


def _check_lists(schedule: Schedule) -> int:
    stages = len(schedule)
    if sorted(schedule) != list(range(stages)) or stages == 0:
        raise ScheduleError(
            f"pipeline schedule must list stages 0..p-1, got stages {sorted(schedule)}"
        )
    for s, order in schedule.items():
        for i, a in enumerate(order):
            where = f"stage {s}, action #{i}"
            if not isinstance(a, Action):
                raise ScheduleError(f"{where}: {a!r} is not an Action")
            if a.stage != s:
                raise ScheduleError(f"{where}: {a.describe()} is in the list of stage {s}")
            if (a.microbatch is None) != (a.kind == ActionKind.UPDATE):
                needs = "takes no" if a.kind == ActionKind.UPDATE else "needs a"
                raise ScheduleError(f"{where}: {a.kind.value} {needs} microbatch")
            if a.microbatch is not None and a.microbatch < 0:
                raise ScheduleError(f"{where}: negative microbatch in {a}")
            if a.peer is not None and not 0 <= a.peer < stages:
                raise ScheduleError(
                    f"{where}: {a} talks to stage {a.peer}, which does not exist "
                    f"(stages 0..{stages - 1})"
                )
    return stages


def _positions(order: list[Action]) -> dict[tuple[ActionKind, int | None], list[int]]:
    found: dict[tuple[ActionKind, int | None], list[int]] = {}
    for i, a in enumerate(order):
        found.setdefault((a.kind, a.microbatch), []).append(i)
    return found


class _StageCheck:
    """The per-stage rules of `validate`, with the messages that name the action at fault."""

    def __init__(self, order: list[Action], stage: int, stages: int, microbatches: int):
        self.order, self.s, self.stages, self.microbatches = order, stage, stages, microbatches
        self.positions = _positions(order)
        self.backward: dict[int, int] = {}  # microbatch -> position of its B or I

    def at(self, kind: ActionKind, mb: int | None) -> list[int]:
        return self.positions.get((kind, mb), [])

    def once(self, kind: ActionKind, mb: int | None, why: str) -> int:
        found = self.at(kind, mb)
        name = str(Action(kind, self.s, mb))
        if not found:
            raise ScheduleError(f"stage {self.s} has no {name}: {why}")
        if len(found) > 1:
            raise ScheduleError(
                f"stage {self.s} runs {name} {len(found)} times (actions #"
                + ", #".join(map(str, found))
                + "); every action runs exactly once"
            )
        return found[0]

    def before(self, first: int, then: int, why: str) -> None:
        if first > then:
            raise ScheduleError(
                f"stage {self.s}: {self.order[then]} (action #{then}) runs before "
                f"{self.order[first]} (action #{first}); {why}"
            )

    def compute(self) -> None:
        """One F and one B (or I then W) per microbatch, the forward first; UPDATE last."""
        K, s = ActionKind, self.s
        for mb in range(self.microbatches):
            f = self.once(
                K.F,
                mb,
                f"every microbatch 0..{self.microbatches - 1} needs a forward on every stage",
            )
            if self.at(K.B, mb) and (self.at(K.I, mb) or self.at(K.W, mb)):
                raise ScheduleError(
                    f"stage {s} runs both B{mb} and a split backward (I{mb}/W{mb}) for "
                    f"microbatch {mb}; use one or the other"
                )
            if self.at(K.I, mb) or self.at(K.W, mb):
                grad = self.once(K.I, mb, f"W{mb} needs the input-gradient part I{mb} too")
                w = self.once(K.W, mb, f"I{mb} needs the weight-gradient part W{mb} too")
                self.before(grad, w, "the weight gradient uses what the input gradient computes")
            else:
                grad = self.once(K.B, mb, "every microbatch needs a backward (B, or I and W)")
            self.before(f, grad, "a microbatch's backward needs its forward")
            self.backward[mb] = grad
        update = self.once(K.UPDATE, None, "every stage ends with the optimizer update")
        if update != len(self.order) - 1:
            raise ScheduleError(
                f"stage {s}: UPDATE is action #{update} of {len(self.order)}; it must come "
                f"last, after {self.order[-1]} and every other gradient"
            )

    def transfers(self) -> None:
        """Receive before use, send after production, each once (after `compute`)."""
        K, s = ActionKind, self.s
        for mb in range(self.microbatches):
            f, grad = self.positions[(K.F, mb)][0], self.backward[mb]
            if s > 0:
                recv = self.once(K.RECV_F, mb, f"F{mb} needs the activations of stage {s - 1}")
                self.before(recv, f, "the forward needs the activations it receives")
                send = self.once(
                    K.SEND_B, mb, f"stage {s - 1} needs the input gradient of microbatch {mb}"
                )
                self.before(grad, send, "a stage sends gradients after computing them")
            if s + 1 < self.stages:
                send = self.once(K.SEND_F, mb, f"stage {s + 1} needs the activations of F{mb}")
                self.before(f, send, "a stage sends activations after computing them")
                recv = self.once(
                    K.RECV_B, mb, f"the backward of microbatch {mb} needs stage {s + 1}'s gradient"
                )
                self.before(recv, grad, "the backward needs the gradient it receives")


def _check_transfers(stages, microbatches, positions) -> None:
    """A SEND with no RECV of the same tensor on the peer, or the other way round (missing
    or repeated pairs are left to `_StageCheck`, which names what the stage lacks)."""
    K = ActionKind
    pairs = [(K.SEND_F, K.RECV_F, +1), (K.SEND_B, K.RECV_B, -1)]
    for s in range(stages):
        for send, recv, step in pairs:
            peer = s + step
            if not 0 <= peer < stages:
                continue
            for mb in range(microbatches):
                sends = len(positions[s].get((send, mb), []))
                recvs = len(positions[peer].get((recv, mb), []))
                if sends == recvs or max(sends, recvs) > 1:
                    continue
                if sends == 1:
                    raise ScheduleError(
                        f"stage {s} {send.value}{mb} has no matching {recv.value}{mb} on "
                        f"stage {peer}; a send blocks until its receive"
                    )
                raise ScheduleError(
                    f"stage {peer} {recv.value}{mb} has no matching {send.value}{mb} on "
                    f"stage {s}; a receive blocks until its send"
                )


def happens_before(schedule: Schedule) -> nx.DiGraph:
    """Nodes (stage, index) for every action; an edge u -> v when v cannot finish before u.

    Each stage runs its list in order. A SEND and its RECV finish together, once both stages
    have reached them: each waits for the action before the other side."""
    graph = nx.DiGraph()
    receive_at = {}
    for s, order in schedule.items():
        for i, a in enumerate(order):
            graph.add_node((s, i), action=a)
            if i:
                graph.add_edge((s, i - 1), (s, i), why="order")
            if a.kind in RECV_KINDS:
                receive_at[(a.peer, a.kind, a.microbatch)] = (s, i)
    partner = {ActionKind.SEND_F: ActionKind.RECV_F, ActionKind.SEND_B: ActionKind.RECV_B}
    for s, order in schedule.items():
        for i, a in enumerate(order):
            if a.kind not in SEND_KINDS:
                continue
            recv = receive_at.get((s, partner[a.kind], a.microbatch))
            if recv is None:
                continue
            graph.nodes[(s, i)]["partner"] = recv
            graph.nodes[recv]["partner"] = (s, i)
            if recv[1]:
                graph.add_edge((recv[0], recv[1] - 1), (s, i), why="meet")
            if i:
                graph.add_edge((s, i - 1), recv, why="meet")
    return graph


def _describe_cycle(schedule: Schedule, graph: nx.DiGraph, cycle) -> str:
    steps = []
    for u, v in cycle:
        a, b = graph.nodes[u]["action"], graph.nodes[v]["action"]
        if graph.edges[u, v]["why"] == "order":
            steps.append(f"{b.describe()} comes after {a} in its list")
        else:
            partner = graph.nodes[graph.nodes[v]["partner"]]["action"]
            steps.append(f"{b.describe()} waits for {partner.describe()}, reached after {a}")
    return (
        "pipeline schedule deadlocks: its stages wait on each other in a cycle: "
        + "; ".join(steps)
        + ". Reorder the sends and receives so that neighbouring stages meet them in the "
        "same order"
    )


# ---------------------------------------------------------------------------------------------
# The simulator


@dataclass(frozen=True)
class Span:
    """One action's time on one stage (simulated), or on one rank of it (measured)."""

    stage: int
    action: Action
    start_s: float
    end_s: float
    rank: int | None = None  # measured timelines: the rank that ran it


@dataclass(frozen=True)
class Timeline:
    """A pipeline step's timeline: simulated by `simulate`, or measured by a runtime."""

    step_seconds: float
    bubble_fraction: float  # share of stage-time not spent computing (waiting, transferring)
    spans: tuple[Span, ...]
    compute_seconds: tuple[float, ...]  # per stage: its F/B/I/W/UPDATE time


def simulate(
    schedule: Schedule,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    comm_s: float | Sequence[float],
    weight_grad_s: float | Sequence[float] | None = None,
    update_s: float | Sequence[float] = 0.0,
) -> Timeline:
    """Estimated timeline of one step of a valid `schedule` (validated here).

    Costs are per microbatch, one per stage (a number means the same on every stage):
    `backward_s` is the whole backward (B, or I and W together); `weight_grad_s` the W part of
    it, so I takes `backward_s - weight_grad_s` (default: half the backward, as for a chain of
    matmuls, whose input- and weight-gradient matmuls have equal FLOPs); `comm_s` one per
    boundary between stage s and s+1 (p-1 of them), for activations forward and gradients
    backward alike. A transfer starts when both stages reach it and holds both for `comm_s`:
    the blocking send/recv that the lists are validated for. Each action starts when the
    previous action of its stage and what it waits for have finished: the longest path through
    the happens-before graph.

    The bubble fraction is 1 - (compute time of all stages) / (stages x step time): with
    uniform stages and no transfer time it is (p-1)/(m+p-1) for GPipe and 1F1B."""
    validate(schedule)
    stages = len(schedule)
    forward = _per_stage("forward_s", forward_s, stages)
    backward = _per_stage("backward_s", backward_s, stages)
    weight = (
        [b / 2 for b in backward]
        if weight_grad_s is None
        else _per_stage("weight_grad_s", weight_grad_s, stages)
    )
    update = _per_stage("update_s", update_s, stages)
    comm = _per_stage("comm_s", comm_s, stages - 1, what="boundaries between stages")
    for s in range(stages):
        if not 0 <= weight[s] <= backward[s]:
            raise ScheduleError(
                f"stage {s}: weight_grad_s={weight[s]} must be between 0 and its whole "
                f"backward_s={backward[s]}"
            )

    compute_cost = {
        ActionKind.F: forward,
        ActionKind.B: backward,
        ActionKind.I: [b - w for b, w in zip(backward, weight)],
        ActionKind.W: weight,
        ActionKind.UPDATE: update,
    }

    def duration(a: Action) -> float:
        if a.peer is not None:
            return comm[min(a.stage, a.peer)]
        return compute_cost[a.kind][a.stage]

    graph = happens_before(schedule)
    end: dict[tuple[int, int], float] = {}
    spans = []
    for node in nx.topological_sort(graph):
        a = graph.nodes[node]["action"]
        start = max((end[p] for p in graph.predecessors(node)), default=0.0)
        end[node] = start + duration(a)
        spans.append(Span(a.stage, a, start, end[node]))
    spans.sort(key=lambda sp: (sp.stage, sp.start_s, sp.end_s))
    step = max(end.values(), default=0.0)
    compute = tuple(
        sum(sp.end_s - sp.start_s for sp in spans if sp.stage == s and sp.action.peer is None)
        for s in range(stages)
    )
    bubble = 1.0 - sum(compute) / (stages * step) if step > 0 else 0.0
    return Timeline(step, bubble, tuple(spans), compute)


def _per_stage(name: str, value, count: int, what: str = "stages") -> list[float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * count
    else:
        values = [float(v) for v in value]
        if len(values) != count:
            raise ScheduleError(
                f"{name}: got {len(values)} value(s) for {count} {what}; give one per "
                f"{what[:-1] if what.endswith('s') else what} or a single number"
            )
    if any(v < 0 for v in values):
        raise ScheduleError(f"{name}: times cannot be negative, got {values}")
    return values


def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most microbatches whose activations it holds at once: those whose F
    has run and whose backward has not finished with them (B, or W when split)."""
    peaks = {}
    for s, order in schedule.items():
        live = peak = 0
        for a in order:
            if a.kind == ActionKind.F:
                live += 1
                peak = max(peak, live)
            elif a.kind in (ActionKind.B, ActionKind.W):
                live -= 1
        peaks[s] = peak
    return peaks


def format_timeline(timeline: Timeline, slot_s: float) -> str:
    """The compute of each stage as text, one row per stage and one 3-character cell per
    `slot_s` seconds: the action running in the middle of the slot, '.' when none runs."""
    stages = 1 + max((sp.stage for sp in timeline.spans), default=-1)
    slots = round(timeline.step_seconds / slot_s)
    rows = []
    for s in range(stages):
        work = [sp for sp in timeline.spans if sp.stage == s and sp.end_s > sp.start_s]
        cells = []
        for k in range(slots):
            t = (k + 0.5) * slot_s
            running = [sp for sp in work if sp.start_s <= t < sp.end_s and sp.action.peer is None]
            cells.append(f"{running[0].action!s:<3}" if running else ".  ")
        rows.append(f"stage {s}: " + "".join(cells).rstrip())
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Chrome trace


def chrome_trace(spans: Iterable[Span], path: str | Path) -> dict:
    """Write `spans` (simulated or measured) as a Chrome trace JSON file (chrome://tracing,
    Perfetto): one thread per stage, or per rank when spans say their rank; complete events
    ("ph": "X") in microseconds. Returns the trace written."""
    events = []
    threads: dict[int, str] = {}
    for sp in spans:
        tid = sp.stage if sp.rank is None else sp.rank
        threads.setdefault(
            tid, f"stage {sp.stage}" if sp.rank is None else f"rank {sp.rank} (stage {sp.stage})"
        )
        a = sp.action
        category = (
            "update"
            if a.kind == ActionKind.UPDATE
            else "send"
            if a.kind in SEND_KINDS
            else "recv"
            if a.kind in RECV_KINDS
            else "compute"
        )
        events.append(
            {
                "name": str(a),
                "cat": category,
                "ph": "X",
                "ts": sp.start_s * 1e6,
                "dur": (sp.end_s - sp.start_s) * 1e6,
                "pid": 0,
                "tid": tid,
                "args": {"stage": sp.stage, "microbatch": a.microbatch},
            }
        )
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
        for tid, name in sorted(threads.items())
    ]
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    try:
        Path(path).write_text(json.dumps(trace, indent=1))
    except OSError as error:
        raise OutputError(f"cannot write the Chrome trace to {path}: {error.strerror}") from None
    return trace
