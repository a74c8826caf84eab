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
from collections.abc import Callable
from dataclasses import dataclass

import networkx as nx

from graphpar.errors import ScheduleError


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
    positions = [_positions(schedule[s]) for s in range(stages)]
    for s in range(stages):
        _check_stage(schedule[s], s, stages, microbatches, positions[s])
    _check_transfers(stages, microbatches, positions)
    graph = happens_before(schedule)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    raise ScheduleError(_describe_cycle(schedule, graph, cycle))


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


def _check_stage(order, s, stages, microbatches, positions) -> None:
    K = ActionKind

    def at(kind: ActionKind, mb: int | None) -> list[int]:
        return positions.get((kind, mb), [])

    def once(kind: ActionKind, mb: int | None, why: str) -> int:
        found = at(kind, mb)
        name = str(Action(kind, s, mb))
        if not found:
            raise ScheduleError(f"stage {s} has no {name}: {why}")
        if len(found) > 1:
            raise ScheduleError(
                f"stage {s} runs {name} {len(found)} times (actions #"
                + ", #".join(map(str, found))
                + "); every action runs exactly once"
            )
        return found[0]

    def before(first: int, then: int, why: str) -> None:
        if first > then:
            raise ScheduleError(
                f"stage {s}: {order[then]} (action #{then}) runs before {order[first]} "
                f"(action #{first}); {why}"
            )

    for mb in range(microbatches):
        f = once(K.F, mb, f"every microbatch 0..{microbatches - 1} needs a forward on every stage")
        if at(K.B, mb) and (at(K.I, mb) or at(K.W, mb)):
            raise ScheduleError(
                f"stage {s} runs both B{mb} and a split backward (I{mb}/W{mb}) for microbatch "
                f"{mb}; use one or the other"
            )
        if at(K.I, mb) or at(K.W, mb):
            grad = once(K.I, mb, f"W{mb} needs the input-gradient part I{mb} too")
            w = once(K.W, mb, f"I{mb} needs the weight-gradient part W{mb} too")
            before(grad, w, "the weight gradient uses what the input gradient computes")
        else:
            grad = once(K.B, mb, "every microbatch needs a backward (B, or I and W) on every stage")
        before(f, grad, "a microbatch's backward needs its forward")
        if s > 0:
            before(
                once(K.RECV_F, mb, f"F{mb} needs the activations of stage {s - 1}"),
                f,
                "the forward needs the activations it receives",
            )
        if s + 1 < stages:
            before(
                f,
                once(K.SEND_F, mb, f"stage {s + 1} needs the activations of F{mb}"),
                "a stage sends activations after computing them",
            )
            before(
                once(K.RECV_B, mb, f"the backward needs the gradient of stage {s + 1}"),
                grad,
                "the backward needs the gradient it receives",
            )
        if s > 0:
            before(
                grad,
                once(K.SEND_B, mb, f"stage {s - 1} needs the input gradient of {mb}"),
                "a stage sends gradients after computing them",
            )
    extra = [
        (kind, mb)
        for (kind, mb) in positions
        if mb is not None
        and (
            mb >= microbatches
            or (s == 0 and kind in (K.RECV_F, K.SEND_B))
            or (s == stages - 1 and kind in (K.SEND_F, K.RECV_B))
        )
    ]
    if extra:
        kind, mb = extra[0]
        raise ScheduleError(
            f"stage {s} has {Action(kind, s, mb)}, but "
            + ("no stage before it" if kind in (K.RECV_F, K.SEND_B) else "no stage after it")
            + " to talk to"
        )
    update = once(K.UPDATE, None, "every stage ends with the optimizer update")
    if update != len(order) - 1:
        raise ScheduleError(
            f"stage {s}: UPDATE is action #{update} of {len(order)}; it must come last, after "
            f"{order[-1]} and every other gradient"
        )


def _check_transfers(stages, microbatches, positions) -> None:
    """Every SEND has exactly one RECV of the same tensor on the peer, and the other way."""
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
                if sends == recvs == 1:
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
