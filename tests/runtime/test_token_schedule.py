"""GPipe over (microbatch, token slice) units: the lists' order, the simulated step with units
of unequal cost, and the Chrome trace naming each unit's microbatch and slice."""

import json

import pytest

from graphpar.cost.timeline import chrome_trace, simulate
from graphpar.ir.schedule import ActionKind, format_schedule, token_unit
from graphpar.passes.pipeline.schedules import gpipe, token_schedule


def test_slices_go_forward_in_order_and_backward_last_first():
    schedule = token_schedule("gpipe", stages=2, microbatches=2, slices=3)
    computed = [str(a) for a in schedule[1] if a.kind in (ActionKind.F, ActionKind.B)]
    assert computed == ["F0", "F1", "F2", "F3", "F4", "F5", "B2", "B1", "B0", "B5", "B4", "B3"]
    assert [token_unit(u, 3) for u in (0, 2, 4)] == [(0, 0), (0, 2), (1, 1)]
    # one slice per microbatch is GPipe itself
    assert format_schedule(token_schedule("gpipe", 3, 4, 1)) == format_schedule(gpipe(3, 4))


def test_units_of_equal_share_give_gpipes_step_over_all_units():
    # K stages, M microbatches of S slices each 1/S of the work: (M S + K - 1) units of F then
    # of B, each 1/S as long as a whole microbatch's.
    stages, microbatches, slices, forward, backward = 3, 2, 4, 3.0, 6.0
    timeline = simulate(token_schedule("gpipe", stages, microbatches, slices), forward, backward,
                        0.0, microbatch_scale=[1 / slices] * (microbatches * slices))
    units = microbatches * slices + stages - 1
    assert timeline.step_seconds == pytest.approx(units * (forward + backward) / slices)
    unsliced = simulate(gpipe(stages, microbatches), forward, backward, 0.0)
    assert timeline.step_seconds < unsliced.step_seconds


def test_scales_apply_to_each_units_compute_and_transfers():
    timeline = simulate(token_schedule("gpipe", 2, 1, 2), 1.0, 2.0, 0.5,
                        microbatch_scale=[0.75, 0.25], comm_scale=[0.5, 0.5])
    spans = {(sp.stage, str(sp.action)): sp.end_s - sp.start_s for sp in timeline.spans}
    assert spans[(0, "F0")] == 0.75 and spans[(0, "F1")] == 0.25
    assert spans[(1, "B1")] == 0.5 and spans[(0, "SEND_F0")] == 0.25


def test_chrome_trace_names_microbatch_and_slice(tmp_path):
    timeline = simulate(token_schedule("gpipe", 2, 2, 3), 1.0, 2.0, 0.0)
    trace = chrome_trace(timeline.spans, tmp_path / "t.json", slices=3)
    forward = [e for e in trace["traceEvents"] if e.get("name") == "F1.2"]
    assert len(forward) == 2  # one per stage
    assert forward[0]["args"]["microbatch"] == 1 and forward[0]["args"]["slice"] == 2
    assert json.loads((tmp_path / "t.json").read_text()) == trace
