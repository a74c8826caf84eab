"""Pipeline schedules: the generators, the validator, the simulator and the trace writer."""

from __future__ import annotations

import pytest

from graphpar.errors import GraphparError, ScheduleError
from graphpar.runtime.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    gpipe,
    one_f_one_b,
    validate,
    zero_bubble_h1,
)

K = ActionKind


def names(order: list[Action]) -> str:
    return " ".join(map(str, order))


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
