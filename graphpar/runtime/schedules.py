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
import math
import re
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


# the work of a stage (what a timeline counts as busy, with UPDATE)
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


# ---------------------------------------------------------------------------------------------
# Token-sliced schedules (TeraPipe): the work items are (microbatch, slice) pairs, numbered
# item = microbatch * slices + slice, and each action's `microbatch` is an item. Within a
# sequence the forwards run in slice order (slice j reads the keys and values of slices < j)
# and the backwards in reverse (slice j's backward reads what later slices' backwards send
# into its keys and values).

TOKEN_SCHEDULES = ("gpipe", "1f1b")


def token_unit(unit: int, slices: int) -> tuple[int, int]:
    """(microbatch, slice) of work item (unit) `unit`."""
    return divmod(unit, slices)


def token_schedule(name: str, stages: int, microbatches: int, slices: int) -> Schedule:
    """GPipe- or 1F1B-style lists over the (microbatch, slice) items, validated.

    - gpipe: every forward in item order, then every backward, microbatch by microbatch,
      slices in reverse.
    - 1f1b: 1F1B over the items with stage s warming up with p-1-s+K-1 forwards (K slices):
      the K-1 extra are the rest of a sequence, which must all have run forward before its
      last slice's backward can start. A stage then holds about p-s items' activations plus
      one sequence, instead of all of them."""
    if name not in TOKEN_SCHEDULES:
        raise ScheduleError(f"unknown token-sliced schedule {name!r}; choose one of "
                            f"{', '.join(TOKEN_SCHEDULES)}")
    _check_sizes(name, stages, microbatches, needs_full_pipeline=False)
    if slices < 1:
        raise ScheduleError(f"schedule {name!r}: needs at least one token slice, got {slices}")
    items = microbatches * slices
    backward = [m * slices + j for m in range(microbatches) for j in reversed(range(slices))]
    orders = {}
    for s in range(stages):
        warmup = items if name == "gpipe" else min(stages - 1 - s + slices - 1, items)
        order = [Action(ActionKind.F, s, w) for w in range(warmup)]
        for k, w in enumerate(range(warmup, items)):
            order += [Action(ActionKind.F, s, w), Action(ActionKind.B, s, backward[k])]
        order += [Action(ActionKind.B, s, w) for w in backward[items - warmup:]]
        orders[s] = order
    schedule = _with_communication(orders)
    validate(schedule)
    validate_token_order(schedule, slices)
    return schedule


def validate_token_order(schedule: Schedule, slices: int) -> None:
    """On every stage, a sequence's forwards in slice order and its backwards in reverse
    (each a prerequisite `validate` cannot see: it travels inside the stage, as keys and
    values and their gradients); ScheduleError naming the stage and actions otherwise."""
    for s, order in schedule.items():
        at = {(a.kind, a.microbatch): i for i, a in enumerate(order)}
        for (kind, item), i in at.items():
            if kind not in (ActionKind.F, ActionKind.B, ActionKind.I) or item is None:
                continue
            m, j = token_unit(item, slices)
            if kind is ActionKind.F and j > 0:
                needed, why = (ActionKind.F, item - 1), "the keys and values of slice"
            elif kind is not ActionKind.F and j + 1 < slices:
                needed = (kind, item + 1)
                why = "the gradients into its keys and values from slice"
            else:
                continue
            before = at.get(needed)
            if before is None or before > i:
                raise ScheduleError(
                    f"stage {s}: {kind.value}{item} (microbatch {m}, slice {j}) needs {why} "
                    f"{token_unit(needed[1], slices)[1]}, which {needed[0].value}{needed[1]} "
                    + ("never computes" if before is None else f"computes later (action "
                       f"#{before}, after #{i})"))


def format_schedule(schedule: Schedule) -> str:
    """The lists as text, one line per stage: 'stage 1: RECV_F0 F0 SEND_F0 ... UPDATE'.
    `parse_schedule` reads it back."""
    return "\n".join(f"stage {s}: " + " ".join(map(str, schedule[s])) for s in sorted(schedule))


_TOKEN = re.compile(r"([A-Z_]+?)(\d*)")


def parse_schedule(text: str) -> Schedule:
    """Read `format_schedule`'s text (a hand-written schedule, a dump) back into lists; the
    result is not validated."""
    schedule: Schedule = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        head, sep, body = line.partition(":")
        words = head.split()
        if not sep or len(words) != 2 or words[0] != "stage" or not words[1].isdigit():
            raise ScheduleError(
                f"schedule text, line {number}: expected 'stage N: ACTION ...', got {line!r}"
            )
        stage = int(words[1])
        if stage in schedule:
            raise ScheduleError(f"schedule text, line {number}: stage {stage} listed twice")
        schedule[stage] = []
        for token in body.split():
            match = _TOKEN.fullmatch(token)
            kind = match and ActionKind.__members__.get(match.group(1))
            if kind is None or (kind == ActionKind.UPDATE) != (match.group(2) == ""):
                raise ScheduleError(
                    f"schedule text, line {number}: {token!r} is not an action; actions are "
                    f"{', '.join(k.value + 'N' for k in ActionKind if k != ActionKind.UPDATE)} "
                    f"(N a microbatch) and UPDATE"
                )
            microbatch = int(match.group(2)) if match.group(2) else None
            schedule[stage].append(Action(kind, stage, microbatch))
    return schedule


# unit costs used only to order communication; any positive costs give a valid order
_ORDERING_COST = {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.I: 1.0, ActionKind.W: 1.0}


def _with_communication(orders: dict[int, list[Action]]) -> Schedule:
    """Insert the SEND/RECV actions into per-stage compute orders and end each with UPDATE.

    Sends and receives block until both sides meet, so any two stages must meet their
    transfers in the same order. We time the compute orders with unit costs and let every
    transfer happen when the action that consumes its data starts: the receiving stage
    receives just before that action, and the sending stage sends at that moment of its own
    timing, after the producing action (which finished no later). Each stage's list is its
    actions in time order; all stages order their transfers by the same key (time, then one
    tie rule), so the earliest pending transfer always has both sides able to reach it and the
    lists never deadlock, whatever the real costs.

    Timing transfers by their consumer rather than their producer keeps a stage from waiting
    for a transfer it does not need yet: on random stage costs, GPipe and 1F1B lists then run
    as fast as their compute orders allow (docs/pipeline-schedules.md)."""
    start = _unit_start_times(orders)
    producer_of = _producers(orders)
    events: dict[int, list[tuple[tuple, Action]]] = {
        s: [((start[a], 1, ()), a) for a in order] for s, order in orders.items()
    }
    for s, order in orders.items():
        for consumer in order:
            producer = producer_of.get(consumer)
            if producer is None:
                continue
            mb, sender = consumer.microbatch, producer.stage
            forward = consumer.kind == ActionKind.F
            send, recv = (
                (ActionKind.SEND_F, ActionKind.RECV_F)
                if forward
                else (ActionKind.SEND_B, ActionKind.RECV_B)
            )
            # equal times: the forward wave goes downstream first and the backward wave
            # upstream first, i.e. a stage sends what it has computed before it receives more
            # (the other way round, a slow stage holds up the sends of those after it)
            key = (start[consumer], 0, (not forward, -sender if forward else sender, mb))
            events[sender].append((key, Action(send, sender, mb)))
            events[s].append((key, Action(recv, s, mb)))
    schedule: Schedule = {}
    for s in orders:
        timed = sorted(events[s], key=lambda event: event[0])
        schedule[s] = [a for _, a in timed] + [Action(ActionKind.UPDATE, s, None)]
    return schedule


def _producers(orders: dict[int, list[Action]]) -> dict[Action, Action]:
    """Consumer -> the action on a neighbouring stage whose data it needs: F(s, m) needs
    F(s-1, m); B or I (s, m) needs the B or I (s+1, m) that computes its input gradient."""
    input_grad = {
        (a.stage, a.microbatch): a
        for order in orders.values()
        for a in order
        if a.kind in INPUT_GRAD_KINDS
    }
    forward = {
        (a.stage, a.microbatch): a
        for order in orders.values()
        for a in order
        if a.kind == ActionKind.F
    }
    producers = {}
    for order in orders.values():
        for a in order:
            if a.kind == ActionKind.F:
                found = forward.get((a.stage - 1, a.microbatch))
            elif a.kind in INPUT_GRAD_KINDS:
                found = input_grad.get((a.stage + 1, a.microbatch))
            else:
                found = None
            if found is not None:
                producers[a] = found
    return producers


def _unit_start_times(orders: dict[int, list[Action]]) -> dict[Action, float]:
    """Start time of every compute action with `_ORDERING_COST`, each stage running its order
    and waiting for the data its actions consume."""
    producer_of = _producers(orders)
    start: dict[Action, float] = {}
    finish: dict[Action, float] = {}
    position = dict.fromkeys(orders, 0)
    clock = dict.fromkeys(orders, 0.0)
    progress = True
    while progress:
        progress = False
        for s, order in orders.items():
            while position[s] < len(order):
                a = order[position[s]]
                producer = producer_of.get(a)
                if producer is not None and producer not in finish:
                    break
                start[a] = max(clock[s], finish[producer] if producer is not None else 0.0)
                clock[s] = finish[a] = start[a] + _ORDERING_COST[a.kind]
                position[s] += 1
                progress = True
    stuck = [order[position[s]] for s, order in orders.items() if position[s] < len(order)]
    if stuck:
        raise ScheduleError(
            "pipeline schedule cannot make progress: "
            + ", ".join(a.describe() for a in stuck)
            + " each wait for data that is never produced"
        )
    return start


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
        raise ScheduleError(_describe_cycle(graph, nx.find_cycle(graph)))


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


def happens_before(schedule: Schedule, blocking_sends: bool = True) -> nx.DiGraph:
    """Nodes (stage, index) for every action; an edge u -> v when v cannot finish before u.

    Each stage runs its list in order. With blocking sends (`torch.distributed.send` on gloo
    moves the data only once the receiver has posted its receive) a SEND and its RECV finish
    together, once both stages have reached them: each waits for the action before the other
    side. With non-blocking sends (isend, waited for at the end of the step) a RECV waits for
    its SEND to be posted, and nothing waits for the RECV."""
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
            if not blocking_sends:
                graph.add_edge((s, i), recv, why="data")
                continue
            if recv[1]:
                graph.add_edge((recv[0], recv[1] - 1), (s, i), why="meet")
            if i:
                graph.add_edge((s, i - 1), recv, why="meet")
    return graph


def _describe_cycle(graph: nx.DiGraph, cycle) -> str:
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
    blocking_sends: bool = True,
    microbatch_scale: Sequence[float] | None = None,
    comm_scale: Sequence[float] | None = None,
) -> Timeline:
    """Estimated timeline of one step of a valid `schedule` (validated here).

    Costs are per microbatch, one per stage (a number means the same on every stage):
    `backward_s` is the whole backward (B, or I and W together); `weight_grad_s` the W part of
    it, so I takes `backward_s - weight_grad_s` (default: half the backward, as for a chain of
    matmuls, whose input- and weight-gradient matmuls have equal FLOPs); `comm_s` one per
    boundary between stage s and s+1 (p-1 of them), for activations forward and gradients
    backward alike. A transfer starts when both stages have reached it and takes `comm_s`; with
    `blocking_sends` (the default, what the lists are validated for) it holds both stages, else
    the sender posts it and goes on. Each action starts when the previous action of its stage
    and what it waits for have finished: the longest path through `happens_before`.

    `microbatch_scale[m]` and `comm_scale[m]` (default 1) multiply microbatch m's compute and
    transfer times: token slices (`token_schedule`) are units of unequal cost.

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
        if a.kind in SEND_KINDS and not blocking_sends:
            return 0.0  # posted; the transfer shows on the receiving side
        if a.peer is not None:
            scale = comm_scale[a.microbatch] if comm_scale is not None else 1.0
            return comm[min(a.stage, a.peer)] * scale
        scale = (microbatch_scale[a.microbatch]
                 if microbatch_scale is not None and a.microbatch is not None else 1.0)
        return compute_cost[a.kind][a.stage] * scale

    graph = happens_before(schedule, blocking_sends)
    end: dict[tuple[int, int], float] = {}
    spans = []
    for node in nx.topological_sort(graph):
        a = graph.nodes[node]["action"]
        start = max((end[p] for p in graph.predecessors(node)), default=0.0)
        end[node] = start + duration(a)
        spans.append(Span(a.stage, a, start, end[node]))
    return timeline_of(spans)


def timeline_of(spans: Iterable[Span]) -> Timeline:
    """The Timeline of spans: simulated (one track per stage) or measured by a runtime (one
    track per rank, `Span.rank`). The step runs from the first start to the last end; the
    bubble fraction is the share of all tracks' time not spent in F/B/I/W/UPDATE, and
    `compute_seconds` a stage's compute time (the mean over its ranks)."""
    spans = sorted(spans, key=lambda sp: (sp.stage, sp.rank or 0, sp.start_s, sp.end_s))
    if not spans:
        return Timeline(0.0, 0.0, (), ())
    step = max(sp.end_s for sp in spans) - min(sp.start_s for sp in spans)
    busy: dict[tuple[int, int | None], float] = {}
    for sp in spans:
        track = (sp.stage, sp.rank)
        work = sp.end_s - sp.start_s if sp.action.peer is None else 0.0
        busy[track] = busy.get(track, 0.0) + work
    stages = 1 + max(sp.stage for sp in spans)
    compute = []
    for s in range(stages):
        tracks = [t for t in busy if t[0] == s]
        compute.append(sum(busy[t] for t in tracks) / len(tracks) if tracks else 0.0)
    bubble = 1.0 - sum(busy.values()) / (len(busy) * step) if step > 0 else 0.0
    return Timeline(step, bubble, tuple(spans), tuple(compute))


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
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ScheduleError(f"{name}: times must be finite and not negative, got {values}")
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


def chrome_trace(spans: Iterable[Span], path: str | Path, slices: int = 0) -> dict:
    """Write `spans` (simulated or measured) as a Chrome trace JSON file (chrome://tracing,
    Perfetto): one thread per stage, or per rank when spans say their rank; complete events
    ("ph": "X") in microseconds. With `slices` > 0 the microbatches are `token_schedule` units,
    named and annotated as (microbatch, slice): "F1.2" is slice 2 of microbatch 1. Returns the
    trace written."""
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
        name, args = str(a), {"stage": sp.stage, "microbatch": a.microbatch}
        if slices and a.microbatch is not None:
            mb, piece = token_unit(a.microbatch, slices)
            name = f"{a.kind.value}{mb}.{piece}"
            args.update(microbatch=mb, slice=piece)
        events.append(
            {
                "name": name,
                "cat": category,
                "ph": "X",
                "ts": sp.start_s * 1e6,
                "dur": (sp.end_s - sp.start_s) * 1e6,
                "pid": 0,
                "tid": tid,
                "args": args,
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
