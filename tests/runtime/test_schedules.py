"""Pipeline schedules: the generators, the validator, the simulator and the trace writer."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphpar.cost.timeline import Span, chrome_trace, format_timeline, simulate, timeline_of
from graphpar.errors import GraphparError, ScheduleError
from graphpar.ir.schedule import (
    COMPUTE_KINDS,
    Action,
    ActionKind,
    Schedule,
    format_schedule,
    parse_schedule,
    peak_in_flight,
    validate,
)
from graphpar.passes.pipeline.schedules import (
    SCHEDULES,
    gpipe,
    make_schedule,
    one_f_one_b,
    zero_bubble_h1,
)

K = ActionKind


def names(order: list[Action]) -> str:
    return " ".join(map(str, order))


def parse(lists: dict[int, str]) -> Schedule:
    """{stage: "F0 SEND_F0 ... UPDATE"} -> a Schedule."""
    return parse_schedule("\n".join(f"stage {s}: {text}" for s, text in lists.items()))


def test_gpipe_lists_for_two_stages():
    schedule = gpipe(2, 2)
    assert names(schedule[0]) == "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1 UPDATE"
    assert names(schedule[1]) == "RECV_F0 F0 RECV_F1 F1 B0 SEND_B0 B1 SEND_B1 UPDATE"


def test_one_f_one_b_lists_for_three_stages():
    schedule = one_f_one_b(3, 4)
    compute = {
        s: names([a for a in order if a.kind in (K.F, K.B)]) for s, order in schedule.items()
    }
    assert compute == {
        0: "F0 F1 F2 B0 F3 B1 B2 B3",
        1: "F0 F1 B0 F2 B1 F3 B2 B3",
        2: "F0 B0 F1 B1 F2 B2 F3 B3",
    }


def test_zero_bubble_holds_back_s_weight_gradients_on_stage_s():
    schedule = zero_bubble_h1(3, 4)
    compute = {
        s: names([a for a in order if a.kind in (K.F, K.I, K.W)]) for s, order in schedule.items()
    }
    assert compute == {
        0: "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
        1: "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        2: "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    }


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_generator_validates_on_the_whole_grid(name):
    """stages 1..8 x microbatches 1..16; the 1F1B family refuses fewer microbatches than
    stages with a message that says what to do."""
    for stages in range(1, 9):
        for microbatches in range(1, 17):
            if name != "gpipe" and microbatches < stages:
                with pytest.raises(
                    ScheduleError,
                    match=f"at least as many microbatches as stages.*{stages} or more",
                ):
                    SCHEDULES[name](stages, microbatches)
                continue
            validate(SCHEDULES[name](stages, microbatches))


def test_schedule_error_is_a_user_error():
    assert issubclass(ScheduleError, GraphparError)


def test_make_schedule_names_the_choices():
    assert make_schedule("1f1b", 2, 2) == one_f_one_b(2, 2)
    with pytest.raises(
        ScheduleError, match="unknown pipeline schedule 'pipedream'.*gpipe, 1f1b, zb"
    ):
        make_schedule("pipedream", 2, 2)
    with pytest.raises(ScheduleError, match="at least one stage and one microbatch"):
        gpipe(0, 4)


# --- the validator rejects broken schedules, naming the stage and action

TWO_STAGE_GPIPE = {
    0: "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1 UPDATE",
    1: "RECV_F0 F0 RECV_F1 F1 B0 SEND_B0 B1 SEND_B1 UPDATE",
}


def test_hand_written_schedule_round_trips():
    assert parse(TWO_STAGE_GPIPE) == gpipe(2, 2)
    validate(parse(TWO_STAGE_GPIPE))
    assert format_schedule(gpipe(2, 2)) == (
        "stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1 UPDATE\n"
        "stage 1: RECV_F0 F0 RECV_F1 F1 B0 SEND_B0 B1 SEND_B1 UPDATE"
    )
    for name, generate in SCHEDULES.items():
        schedule = generate(3, 5)
        assert parse_schedule(format_schedule(schedule)) == schedule, name


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stage 0: F0 X3 UPDATE", r"line 1: 'X3' is not an action; actions are F.*and UPDATE"),
        ("stage 0: F UPDATE", "line 1: 'F' is not an action"),
        ("stage 0: F0 UPDATE2", "line 1: 'UPDATE2' is not an action"),
        ("stage 0: F0\n\nstage 0: B0", "line 3: stage 0 listed twice"),
        ("F0 B0 UPDATE", "line 1: expected 'stage N: ACTION ...'"),
    ],
)
def test_parse_schedule_names_the_bad_line(text, message):
    with pytest.raises(ScheduleError, match=message):
        parse_schedule(text)


@pytest.mark.parametrize(
    ("stage", "text", "message"),
    [
        (  # backward before forward
            1,
            "RECV_F0 B0 RECV_F1 F0 F1 SEND_B0 B1 SEND_B1 UPDATE",
            r"stage 1: B0 \(action #1\) runs before F0 \(action #3\); a microbatch's "
            r"backward needs its forward",
        ),
        (  # a send that nobody receives
            1,
            "RECV_F0 F0 F1 B0 SEND_B0 B1 SEND_B1 UPDATE",
            "stage 0 SEND_F1 has no matching RECV_F1 on stage 1",
        ),
        (  # microbatch 1 missing on stage 1 (and so the transfers that would carry it)
            1,
            "RECV_F0 F0 B0 SEND_B0 UPDATE",
            "stage 1 has no F1: every microbatch 0..1 needs a forward",
        ),
        (  # a microbatch run twice
            1,
            "RECV_F0 F0 RECV_F1 F1 F1 B0 SEND_B0 B1 SEND_B1 UPDATE",
            r"stage 1 runs F1 2 times \(actions #3, #4\)",
        ),
        (  # the update before the last gradient
            1,
            "RECV_F0 F0 RECV_F1 F1 B0 SEND_B0 B1 UPDATE SEND_B1",
            "stage 1: UPDATE is action #7 of 9; it must come last",
        ),
        (  # the receive after the forward that needs it
            1,
            "F0 RECV_F0 RECV_F1 F1 B0 SEND_B0 B1 SEND_B1 UPDATE",
            r"stage 1: F0 \(action #0\) runs before RECV_F0 \(action #1\)",
        ),
        (  # a split backward missing its weight-gradient part
            1,
            "RECV_F0 F0 RECV_F1 F1 I0 SEND_B0 B1 SEND_B1 UPDATE",
            "stage 1 has no W0: I0 needs the weight-gradient part W0",
        ),
        (  # talking to a stage that does not exist
            1,
            "RECV_F0 F0 RECV_F1 F1 SEND_F1 B0 SEND_B0 B1 SEND_B1 UPDATE",
            "stage 1, action #4: SEND_F1 talks to stage 2, which does not exist",
        ),
    ],
)
def test_validator_rejects(stage, text, message):
    with pytest.raises(ScheduleError, match=message):
        validate(parse({**TWO_STAGE_GPIPE, stage: text}))


def test_validator_finds_a_two_stage_wait_cycle():
    """Stage 0 blocks sending F1 until stage 1 receives it; stage 1 first sends B0, which
    blocks until stage 0 receives it, after its send: neither moves."""
    stage_0 = "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1 UPDATE"
    deadlock = parse({0: stage_0, 1: "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 UPDATE"})
    with pytest.raises(ScheduleError, match="deadlocks") as error:
        validate(deadlock)
    assert "stage 0 SEND_F1" in str(error.value) and "stage 1 SEND_B0" in str(error.value)
    # the same lists with stage 1 receiving F1 before sending B0 are fine
    validate(parse({0: stage_0, 1: "RECV_F0 F0 B0 RECV_F1 SEND_B0 F1 B1 SEND_B1 UPDATE"}))


# --- the simulator


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 2), (4, 8), (4, 4), (3, 7)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_uniform_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, stages, microbatches):
    forward, backward = 1.5, 3.0
    timeline = simulate(SCHEDULES[name](stages, microbatches), forward, backward, 0.0)
    p, m = stages, microbatches
    assert timeline.step_seconds == pytest.approx((m + p - 1) * (forward + backward), rel=1e-12)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-12)
    # every stage computes m (F + B)
    for s in range(stages):
        work = [sp for sp in timeline.spans if sp.stage == s and sp.action.kind in COMPUTE_KINDS]
        assert sum(sp.end_s - sp.start_s for sp in work) == pytest.approx(m * 4.5, rel=1e-12)
        assert timeline.compute_seconds[s] == pytest.approx(m * 4.5, rel=1e-12)
    # the overhead over the bubble-free step m (F + B) is (p - 1) / m
    ideal = m * (forward + backward)
    assert timeline.step_seconds / ideal - 1 == pytest.approx((p - 1) / m, rel=1e-12, abs=1e-12)


def test_in_flight_microbatches():
    p, m = 4, 8
    assert peak_in_flight(gpipe(p, m)) == dict.fromkeys(range(p), m)
    assert peak_in_flight(one_f_one_b(p, m)) == {s: p - s for s in range(p)}
    zb = peak_in_flight(zero_bubble_h1(p, m))
    # ZB-H1 keeps activations until W, but never more than 1F1B's first stage
    assert max(zb.values()) == max(peak_in_flight(one_f_one_b(p, m)).values()) == p


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (4, 8), (5, 6), (8, 16)])
def test_zero_bubble_beats_1f1b_when_weight_gradients_cost_as_much_as_input_gradients(
    stages, microbatches
):
    forward, backward, weight = 1.0, 2.0, 1.0  # I = W = F
    zb = simulate(zero_bubble_h1(stages, microbatches), forward, backward, 0.0, weight)
    ofob = simulate(one_f_one_b(stages, microbatches), forward, backward, 0.0, weight)
    assert zb.bubble_fraction < ofob.bubble_fraction
    # the paper's ZB-H1 bubble: (p-1)(F + I - W) per stage instead of 1F1B's (p-1)(F + I + W)
    p, m = stages, microbatches
    assert zb.step_seconds == pytest.approx(m * 3.0 + (p - 1) * 1.0, rel=1e-12)
    assert ofob.step_seconds == pytest.approx((m + p - 1) * 3.0, rel=1e-12)


def test_format_timeline_of_two_stage_gpipe():
    timeline = simulate(gpipe(2, 2), 1.0, 2.0, 0.0)
    assert format_timeline(timeline, 1.0) == (
        "stage 0: F0 F1 .  .  .  B0 B0 B1 B1\nstage 1: .  F0 F1 B0 B0 B1 B1 .  ."
    )


def test_cost_lists_must_fit_the_stages():
    with pytest.raises(ScheduleError, match="comm_s: got 3 value.*for 2 boundaries"):
        simulate(gpipe(3, 3), 1.0, 1.0, [0.1, 0.1, 0.1])
    with pytest.raises(ScheduleError, match="forward_s: times must be finite and not negative"):
        simulate(gpipe(2, 2), [1.0, float("nan")], 1.0, 0.0)
    with pytest.raises(ScheduleError, match="weight_grad_s=3.0 must be between 0 and"):
        simulate(zero_bubble_h1(2, 2), 1.0, 2.0, 0.0, weight_grad_s=3.0)


def execute(schedule, cost, blocking_sends):
    """An independent executor of the lists: each stage a process that runs its actions in
    order. A blocking SEND and its RECV wait for each other, then both take the transfer
    time; a non-blocking SEND is posted and the stage goes on, its RECV waits for it."""
    clock = dict.fromkeys(schedule, 0.0)
    pc = dict.fromkeys(schedule, 0)
    spans, posted = {}, {}
    partner = {K.SEND_F: K.RECV_F, K.SEND_B: K.RECV_B, K.RECV_F: K.SEND_F, K.RECV_B: K.SEND_B}

    def run(stage, action, start, end):
        spans[action] = (start, end)
        clock[stage] = end
        pc[stage] += 1

    while any(pc[s] < len(schedule[s]) for s in schedule):
        moved = False
        for s, order in schedule.items():
            if pc[s] == len(order):
                continue
            a = order[pc[s]]
            if a.peer is None:
                run(s, a, clock[s], clock[s] + cost(a))
            elif not blocking_sends and a.kind in (K.SEND_F, K.SEND_B):
                posted[a] = clock[s]
                run(s, a, clock[s], clock[s])
            elif not blocking_sends:
                send = Action(partner[a.kind], a.peer, a.microbatch)
                if send not in posted:
                    continue
                start = max(clock[s], posted[send])
                run(s, a, start, start + cost(a))
            else:
                p = a.peer
                other = schedule[p][pc[p]] if pc[p] < len(schedule[p]) else None
                if other != Action(partner[a.kind], p, a.microbatch):
                    continue
                start = max(clock[s], clock[p])
                run(s, a, start, start + cost(a))
                run(p, other, start, start + cost(a))
            moved = True
        if not moved:
            raise Deadlocked(
                {s: order[pc[s]] for s, order in schedule.items() if pc[s] < len(order)}
            )
    return max(clock.values()), spans


class Deadlocked(Exception):
    """The executor found every unfinished stage waiting."""


def oracle_accepts(schedule) -> bool:
    """validate's contract, checked directly: the right actions once each in a sound order
    on every stage, and the lists run to the end on the executor with blocking sends."""
    stages = len(schedule)
    microbatches = 1 + max(
        a.microbatch for order in schedule.values() for a in order if a.microbatch is not None
    )
    for s, order in schedule.items():
        count = Counter((a.kind, a.microbatch) for a in order)
        if count[(K.UPDATE, None)] != 1 or order[-1].kind != K.UPDATE:
            return False
        at = {(a.kind, a.microbatch): i for i, a in enumerate(order)}
        for mb in range(microbatches):
            split = bool(count[(K.I, mb)] or count[(K.W, mb)])
            expected = {
                K.F: 1,
                K.B: int(not split),
                K.I: int(split),
                K.W: int(split),
                K.RECV_F: int(s > 0),
                K.SEND_B: int(s > 0),
                K.SEND_F: int(s < stages - 1),
                K.RECV_B: int(s < stages - 1),
            }
            if any(count[(kind, mb)] != n for kind, n in expected.items()):
                return False
            f, grad = at[(K.F, mb)], at[(K.I if split else K.B, mb)]
            ordered = [f < grad, not split or grad < at[(K.W, mb)]]
            if s > 0:
                ordered += [at[(K.RECV_F, mb)] < f, grad < at[(K.SEND_B, mb)]]
            if s < stages - 1:
                ordered += [f < at[(K.SEND_F, mb)], at[(K.RECV_B, mb)] < grad]
            if not all(ordered):
                return False
    try:
        execute(schedule, lambda a: 1.0, blocking_sends=True)
    except Deadlocked:
        return False
    return True


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    stages=st.integers(2, 4),
    extra=st.integers(0, 2),
    data=st.data(),
)
def test_validator_agrees_with_running_the_lists(name, stages, extra, data):
    """Random edits of a valid schedule (move, swap, drop or repeat an action on a stage):
    validate accepts exactly those the oracle accepts, deadlocks found by running them."""
    schedule = {s: list(order) for s, order in SCHEDULES[name](stages, stages + extra).items()}
    for _ in range(data.draw(st.integers(1, 2))):
        s = data.draw(st.integers(0, stages - 1))
        order = schedule[s]
        i = data.draw(st.integers(0, len(order) - 1))
        edit = data.draw(st.sampled_from(["move", "move", "swap", "drop", "repeat"]))
        if edit == "move":
            order.insert(data.draw(st.integers(0, len(order) - 1)), order.pop(i))
        elif edit == "swap" and i + 1 < len(order):
            order[i], order[i + 1] = order[i + 1], order[i]
        elif edit == "drop" and len(order) > 1:
            order.pop(i)
        elif edit == "repeat":
            order.insert(i, order[i])
    accepted = oracle_accepts(schedule)
    if accepted:
        validate(schedule)
    else:
        with pytest.raises(ScheduleError):
            validate(schedule)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    stages=st.integers(1, 5),
    extra=st.integers(0, 4),
    blocking_sends=st.booleans(),
    data=st.data(),
)
def test_simulation_matches_an_independent_executor(name, stages, extra, blocking_sends, data):
    """Random per-stage costs: the longest path through the happens-before graph gives
    exactly the times of running the lists with blocking or non-blocking sends."""
    microbatches = stages + extra
    times = st.floats(0.01, 5.0)
    forward = data.draw(st.lists(times, min_size=stages, max_size=stages))
    backward = data.draw(st.lists(times, min_size=stages, max_size=stages))
    fraction = data.draw(st.floats(0.0, 1.0))
    comm = data.draw(st.lists(st.floats(0.0, 1.0), min_size=stages - 1, max_size=stages - 1))
    weight = [b * fraction for b in backward]
    schedule = SCHEDULES[name](stages, microbatches)
    timeline = simulate(schedule, forward, backward, comm, weight, blocking_sends=blocking_sends)

    def cost(a):
        if a.kind in (K.SEND_F, K.SEND_B) and not blocking_sends:
            return 0.0
        if a.peer is not None:
            return comm[min(a.stage, a.peer)]
        return {K.F: forward, K.B: backward, K.W: weight, K.UPDATE: [0.0] * stages}.get(
            a.kind, [b - w for b, w in zip(backward, weight)]
        )[a.stage]

    step, spans = execute(schedule, cost, blocking_sends)
    assert timeline.step_seconds == pytest.approx(step, rel=1e-12)
    for span in timeline.spans:
        assert (span.start_s, span.end_s) == pytest.approx(spans[span.action], rel=1e-12)
    # no step is shorter than the busiest stage or than one microbatch through every stage
    assert step >= max(timeline.compute_seconds) * (1 - 1e-12)
    assert step >= (sum(forward) + sum(backward) + 2 * sum(comm)) * (1 - 1e-12)
    if not blocking_sends:  # the sender never waits, so no step is longer than a blocking one
        blocking = simulate(schedule, forward, backward, comm, weight)
        assert step <= blocking.step_seconds * (1 + 1e-12)


# --- the Chrome trace


def test_chrome_trace_loads_back(tmp_path):
    timeline = simulate(one_f_one_b(2, 2), 0.001, 0.002, 0.0005)
    chrome_trace(timeline.spans, tmp_path / "sim.json")
    trace = json.loads((tmp_path / "sim.json").read_text())
    work = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(work) == sum(len(order) for order in one_f_one_b(2, 2).values())
    f1 = next(e for e in work if e["name"] == "F1" and e["tid"] == 1)
    span = next(sp for sp in timeline.spans if sp.stage == 1 and str(sp.action) == "F1")
    assert f1["ts"] == pytest.approx(span.start_s * 1e6) and f1["dur"] == pytest.approx(1000.0)
    assert f1["cat"] == "compute" and f1["args"] == {"stage": 1, "microbatch": 1}
    names_ = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names_ == {0: "stage 0", 1: "stage 1"}


def test_chrome_trace_of_a_measured_timeline_has_one_thread_per_rank(tmp_path):
    measured = [
        Span(0, Action(K.F, 0, 0), 0.0, 0.5, rank=0),
        Span(0, Action(K.F, 0, 0), 0.0, 0.6, rank=1),
        Span(1, Action(K.RECV_F, 1, 0), 0.0, 0.7, rank=2),
    ]
    trace = chrome_trace(measured, tmp_path / "measured.json")
    assert json.loads((tmp_path / "measured.json").read_text()) == trace
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert threads == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 0)", 2: "rank 2 (stage 1)"}
    assert [e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"] == [
        "compute",
        "compute",
        "recv",
    ]


def test_chrome_trace_to_an_unwritable_path_is_a_user_error(tmp_path):
    with pytest.raises(GraphparError, match="cannot write the Chrome trace"):
        chrome_trace([], tmp_path / "no" / "such" / "dir.json")


# --- Alpa's step-time estimate (Eq. 2) against the simulator


def alpa_step_estimate(stage_seconds, microbatches):
    """Alpa Eq. 2: the first microbatch through every stage, then B-1 more at the slowest."""
    return sum(stage_seconds) + (microbatches - 1) * max(stage_seconds)


@settings(max_examples=25, deadline=None)
@given(stages=st.integers(1, 6), extra=st.integers(0, 8), data=st.data())
def test_alpa_estimate_is_exact_for_gpipe_and_bounds_1f1b(stages, extra, data):
    """Random stage times, backward twice the forward, no transfer time: GPipe takes exactly
    sum(t) + (B-1) max(t); 1F1B at most that and at least the slowest stage's B t_max; with no
    stage faster than one before it, 1F1B takes exactly Eq. 2 too."""
    microbatches = stages + extra
    times = data.draw(st.lists(st.floats(0.1, 4.0), min_size=stages, max_size=stages))
    if data.draw(st.booleans()):
        times.sort()

    def step(name):
        forward, backward = [t / 3 for t in times], [2 * t / 3 for t in times]
        schedule = SCHEDULES[name](stages, microbatches)
        return simulate(schedule, forward, backward, 0.0).step_seconds

    expected = alpa_step_estimate(times, microbatches)
    assert step("gpipe") == pytest.approx(expected, rel=1e-12)
    one_f_one_b_step = step("1f1b")
    assert microbatches * max(times) * (1 - 1e-12) <= one_f_one_b_step
    assert one_f_one_b_step <= expected * (1 + 1e-12)
    if times == sorted(times):
        assert one_f_one_b_step == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("slowest", "expected"), [(0, 32.0), (1, 33.0), (2, 34.0)])
def test_alpa_estimate_overcounts_the_stages_after_the_slowest_under_1f1b(slowest, expected):
    """One stage of 4 s among stages of 1 s, B = 8: Eq. 2 (35 s) counts the first
    microbatch's trip through the stages after the slow one, but under 1F1B they work while
    it does. The step is the stages before it once, then the slow stage's B x 4 = 32 s; GPipe
    takes Eq. 2."""
    times = [1.0] * 4
    times[slowest] = 4.0
    forward, backward = [t / 3 for t in times], [2 * t / 3 for t in times]
    assert alpa_step_estimate(times, 8) == 35.0
    gpipe_step = simulate(gpipe(4, 8), forward, backward, 0.0).step_seconds
    assert gpipe_step == pytest.approx(35.0, rel=1e-12)
    one_f_one_b_step = simulate(one_f_one_b(4, 8), forward, backward, 0.0).step_seconds
    assert one_f_one_b_step == pytest.approx(expected, rel=1e-12)
    assert expected == sum(times[:slowest]) + 8 * 4.0


def test_timeline_of_measured_spans_counts_every_rank():
    """Two ranks of stage 0 and one of stage 1, each busy 3 s of a 4 s step."""
    F, B = Action(K.F, 0, 0), Action(K.B, 0, 0)
    measured = [
        Span(0, F, 10.0, 11.0, rank=0),
        Span(0, B, 12.0, 14.0, rank=0),
        Span(0, F, 10.0, 11.5, rank=1),
        Span(0, B, 12.0, 13.5, rank=1),
        Span(1, Action(K.RECV_F, 1, 0), 10.0, 11.5, rank=2),  # waiting is not compute
        Span(1, Action(K.F, 1, 0), 11.5, 12.0, rank=2),
        Span(1, Action(K.B, 1, 0), 12.0, 14.0, rank=2),
    ]
    timeline = timeline_of(measured)
    assert timeline.step_seconds == 4.0
    assert timeline.compute_seconds == (3.0, 2.5)
    assert timeline.bubble_fraction == pytest.approx(1 - (3 + 3 + 2.5) / (3 * 4.0), rel=1e-12)
