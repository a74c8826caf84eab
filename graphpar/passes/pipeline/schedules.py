"""Pipeline schedule generators: GPipe, 1F1B and ZB-H1 per-stage action lists, and the token-
sliced schedules of TeraPipe, each validated (`graphpar.ir.schedule`)."""

from __future__ import annotations

from collections.abc import Callable

from graphpar.errors import ScheduleError
from graphpar.ir.schedule import (
    INPUT_GRAD_KINDS,
    Action,
    ActionKind,
    Schedule,
    validate,
    validate_token_order,
)

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
