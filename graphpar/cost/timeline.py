"""Pipeline timelines: a schedule's dry run on per-stage costs (`simulate`, estimated), the
timeline of measured spans (`timeline_of`), and Chrome traces of either."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from graphpar.errors import OutputError, ScheduleError
from graphpar.ir.schedule import (
    RECV_KINDS,
    SEND_KINDS,
    Action,
    ActionKind,
    Schedule,
    happens_before,
    token_unit,
    validate,
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
