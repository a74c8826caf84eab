"""Pipeline schedules as data: per-stage action lists, their text form and their validator.

A schedule says, for every pipeline stage, the static list of actions that each rank of the
stage's sub-mesh executes in order: forward and backward work on microbatches, the blocking
sends and receives that move activations and gradients between neighbouring stages, and the
optimizer update at the end. `validate` proves a list complete and deadlock-free before any
process starts. The generators (GPipe, 1F1B, ZB-H1, token slices) are in
`graphpar.passes.pipeline.schedules`; the simulator and traces in `graphpar.cost.timeline`.
"""

from __future__ import annotations

import enum
import re
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




def token_unit(unit: int, slices: int) -> tuple[int, int]:
    """(microbatch, slice) of work item (unit) `unit`."""
    return divmod(unit, slices)



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
