"""The real run behind the simulator check: both placements serve every request of the trace
on two worker processes, never faster than the measured service time."""

import pytest


@pytest.mark.slow
def test_both_placements_serve_the_trace_on_two_processes():
    from graphpar.placement.real_check import real_check

    r = real_check(rate=8.0, duration=8.0, warmup=1.0)
    fastest = min(r["service_s"]["whole"].values())
    for mode in ("simple", "pipeline"):
        assert r[mode]["measured_mean_s"] >= 0.5 * fastest  # all finished (NaN fails this)
        assert r[mode]["simulated_mean_s"] >= 0.5 * fastest
        assert 0.0 <= r[mode]["measured_attainment"] <= 1.0
