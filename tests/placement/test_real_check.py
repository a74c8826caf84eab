"""The real run behind the simulator check: what the simulator is given (calibrated service
times plus the fixed costs of a request), and both placements serving every request of the
trace on two worker processes."""

import pytest

from graphpar.placement.real_check import _groups

# seconds as binary fractions, so that the sums below are exact
CAL = {"whole": {"a": 0.5, "b": 0.25}, "stages": {"a": (0.25, 0.25), "b": (0.125, 0.125)},
       "send": 2**-6, "wake": [2**-8, 2**-9]}


def test_the_simulator_gets_service_times_plus_the_fixed_costs_of_a_request():
    simple = _groups("simple", CAL)
    assert [g.stage_latency for g in simple] == [{"a": [0.5 + 2**-8]}, {"b": [0.25 + 2**-9]}]
    (pipeline,) = _groups("pipeline", CAL)
    # wake-up lateness and the send to the next stage ride on the first stage
    first = 2**-8 + 2**-6
    assert pipeline.stage_latency == {"a": [0.25 + first, 0.25], "b": [0.125 + first, 0.125]}
    seen = {"a": (0.5, 0.5), "b": (0.25, 0.75)}
    (again,) = _groups("pipeline", CAL, seen)
    assert again.stage_latency == {"a": [0.5 + first, 0.5], "b": [0.25 + first, 0.75]}


@pytest.mark.slow
def test_both_placements_serve_the_trace_on_two_processes():
    from graphpar.placement.real_check import real_check

    r = real_check(rate=8.0, duration=8.0, warmup=1.0, repeats=5)
    fastest = min(r["service_s"]["whole"].values())
    for mode in ("simple", "pipeline"):
        for key in ("measured_mean_s", "simulated_mean_s", "simulated_in_run_mean_s"):
            assert r[mode][key] >= 0.5 * fastest  # all finished (NaN fails this)
        assert 0.0 <= r[mode]["measured_attainment"] <= 1.0
