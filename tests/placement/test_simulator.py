"""The placement simulator and workloads on hand-checkable cases."""

import numpy as np
import pytest

from graphpar.errors import PlacementError, PlacementSpecError
from graphpar.placement.simulator import SimGroup, simulate
from graphpar.placement.workload import Workload, gamma_workload, load_trace, save_trace


def _w(times, ids, models=("a", "b")):
    return Workload(tuple(models), np.array(times, float), np.array(ids, np.int64),
                    max(times) + 1)


def test_stage_clocks_pipeline_requests_and_reject_what_would_miss_the_slo():
    w = _w([0.0, 0.0, 0.0, 0.05], [0, 0, 0, 1])
    res = simulate([SimGroup({"a": [0.1, 0.1], "b": [0.1, 0.1]})], w, slo=0.35)
    # stage clocks: finishes at 0.2, 0.3, then 0.4 > 0.35 is rejected; b enters stage 0 at 0.2
    np.testing.assert_allclose(res.finish[:2], [0.2, 0.3])
    assert np.isnan(res.finish[2])
    assert res.finish[3] == pytest.approx(0.4)
    assert res.attainment == pytest.approx(3 / 4)
    assert res.attainment_per_model() == {"a": pytest.approx(2 / 3), "b": 1.0}


def test_a_held_receive_costs_a_busy_stage_and_not_an_idle_one():
    w = _w([0.0, 0.0, 10.0], [0, 0, 0], models=("a",))
    plain = SimGroup({"a": [1.0, 2.0]})
    held = SimGroup({"a": [1.0, 2.0]}, receive={"a": [0.0, 0.25]})
    np.testing.assert_allclose(simulate([plain], w).finish, [3.0, 5.0, 13.0])
    # the 1st finds stage 1 idle; the 2nd's input (ready at 2.0) waits for stage 1 to free at
    # 3.0 and then takes 0.25 to arrive; the 3rd comes to an idle pipeline again
    np.testing.assert_allclose(simulate([held], w).finish, [3.0, 5.25, 13.0])


def test_service_times_that_vary_move_the_clocks_but_not_the_controller_s_choice():
    w = _w([0.0, 0.0, 0.0], [0, 0, 0], models=("a",))
    group = SimGroup({"a": [1.0, 1.0]})
    # the 1st request's first stage takes 3x its latency: the 2nd queues behind it, and the
    # 3rd is rejected on the clocks as they are and the profile's latencies (5 + 1 > 5.5)
    draws = np.array([[3.0, 1.0], [1.0, 0.5], [1.0, 1.0]])
    res = simulate([group], w, slo=5.5, service_scale=draws)
    np.testing.assert_allclose(res.finish[:2], [4.0, 4.5])
    assert np.isnan(res.finish[2])
    # admitted on the profile (finish at 3.0), the 2nd request takes 3x in its second stage:
    # served late, so missed
    late = simulate([group], w, slo=3.0, service_scale=np.array([[1.0, 1.0], [1.0, 3.0],
                                                                    [1.0, 1.0]]))
    np.testing.assert_allclose(late.finish[:2], [2.0, 5.0])
    assert late.good.tolist() == [True, False, False]
    # all ones is the plain simulator
    np.testing.assert_array_equal(
        simulate([group], w, service_scale=np.ones((3, 2))).finish,
        simulate([group], w).finish)
    with pytest.raises(PlacementError, match="service_scale must be"):
        simulate([group], w, service_scale=np.ones((2, 2)))


def test_the_controller_picks_the_group_that_finishes_soonest():
    w = _w([0.0, 0.0, 0.0], [0, 0, 0], models=("a",))
    res = simulate([SimGroup({"a": [1.0]}), SimGroup({"a": [0.5, 0.5]})], w)
    # 1st: both finish at 1.0 (the first group wins the tie); 2nd: 2.0 on the single device
    # vs 1.0 on the idle pipeline; 3rd: 2.0 vs 1.5, the pipeline's second stage frees first
    np.testing.assert_allclose(res.finish, [1.0, 1.0, 1.5])


def test_warmup_requests_are_served_but_not_counted():
    w = _w([0.0, 0.0, 5.0], [0, 0, 0], models=("a",))
    res = simulate([SimGroup({"a": [1.0]})], w, slo=1.5, warmup=1.0)
    assert np.isnan(res.finish[1])  # rejected, but inside the warm-up window
    assert res.attainment == 1.0


def test_batching_joins_a_queued_batch_of_the_same_model():
    w = _w([0.0, 0.1, 0.2], [0, 0, 0], models=("a",))
    one = simulate([SimGroup({"a": [1.0]})], w, slo=10)
    np.testing.assert_allclose(one.finish, [1.0, 2.0, 3.0])
    batched = simulate([SimGroup({"a": [1.0]})], w, slo=10, max_batch=2,
                       batch_scale=[0, 1.0, 1.5])
    # requests 2 and 3 form one batch behind request 1: it starts at 1.0 and takes 1.5 s
    np.testing.assert_allclose(batched.finish, [1.0, 2.5, 2.5])


def test_a_model_with_no_group_is_all_rejected():
    w = _w([0.0, 1.0], [0, 1])
    res = simulate([SimGroup({"a": [0.1]})], w)
    assert res.attainment == 0.5 and res.rejected == 1


def test_seeds_are_deterministic():
    a = gamma_workload(["x", "y"], 10, 2, 100, power_law=0.5, seed=7)
    b = gamma_workload(["x", "y"], 10, 2, 100, power_law=0.5, seed=7)
    np.testing.assert_array_equal(a.arrivals, b.arrivals)
    assert a.rate("x") > a.rate("y")


def test_traces_round_trip_and_name_the_bad_line(tmp_path):
    w = gamma_workload(["x", "y"], 5, 1, 20, seed=1)
    save_trace(w, tmp_path / "t.csv")
    back = load_trace(tmp_path / "t.csv")
    np.testing.assert_array_equal(back.arrivals, w.arrivals)
    assert [back.models[i] for i in back.model_ids] == [w.models[i] for i in w.model_ids]
    bad = tmp_path / "bad.csv"
    bad.write_text("model,arrival_s\nx,0.5\ny,soon\n")
    with pytest.raises(PlacementSpecError, match=r"bad.csv:3: arrival_s 'soon'"):
        load_trace(bad)
    with pytest.raises(PlacementSpecError, match=r"bad.csv:2: unknown model 'x'"):
        load_trace(bad, models=["y"])


def test_window_fits_recover_a_gamma_process_and_resample_it():
    from graphpar.placement.workload import fit_windows, resample

    w = gamma_workload(["x"], 40.0, 2.0, 600.0, seed=2)
    fit = fit_windows(w, 300.0)
    assert fit.rates.shape == (2, 1)
    np.testing.assert_allclose(fit.rates[:, 0], 40.0, rtol=0.1)
    np.testing.assert_allclose(fit.cvs[:, 0], 2.0, rtol=0.15)
    doubled = resample(fit, ["x"], rate_scale=2.0, seed=1)
    assert doubled.rate() == pytest.approx(80.0, rel=0.1)


def test_maf2_like_traces_are_burstier_and_more_skewed_than_maf1():
    from graphpar.placement.workload import fit_windows, maf_like

    names = [f"f{i}" for i in range(6)]
    steady = maf_like("maf1", names, 60.0, 1200.0, seed=0)
    bursty = maf_like("maf2", names, 60.0, 1200.0, seed=0)
    assert fit_windows(bursty, 60.0).cvs.mean() > 2 * fit_windows(steady, 60.0).cvs.mean()
    share = lambda w: max(w.rate(m) for m in names) / w.rate()  # noqa: E731
    assert share(bursty) > 1.5 * share(steady)
    with pytest.raises(PlacementSpecError, match="maf3"):
        maf_like("maf3", names, 1.0, 10.0)
