"""The real run behind the simulator check: what the simulator is given (calibrated service
times plus the fixed costs of a request), and both placements serving every request of the
trace on two worker processes."""

import json
from pathlib import Path

import numpy as np
import pytest

from graphpar.placement.real_compare import (
    breakdown,
    compare,
    errors,
    finish_times,
    part_of,
    per_request,
    sim_groups,
    speed_around,
    spread_draws,
)
from graphpar.placement.workload import Workload

# seconds as binary fractions, so that the sums below are exact
CAL = {"whole": {"a": 0.5, "b": 0.25}, "stages": {"a": (0.25, 0.25), "b": (0.125, 0.125)},
       "send": 2**-6, "receive": 2**-7, "wake": [2**-8, 2**-9]}


def test_the_simulator_gets_service_times_plus_the_fixed_costs_of_a_request():
    simple = sim_groups("simple", CAL)
    assert [g.stage_latency for g in simple] == [{"a": [0.5 + 2**-8]}, {"b": [0.25 + 2**-9]}]
    (pipeline,) = sim_groups("pipeline", CAL)
    # wake-up lateness and the one-way send ride on the first stage; the receive of a send
    # held while the second stage was busy on the second stage's clock
    first = 2**-8 + 2**-6
    assert pipeline.stage_latency == {"a": [0.25 + first, 0.25], "b": [0.125 + first, 0.125]}
    assert pipeline.receive == {"a": [0.0, 2**-7], "b": [0.0, 2**-7]}
    seen = {"a": (0.5, 0.5), "b": (0.25, 0.75)}
    (again,) = sim_groups("pipeline", CAL, seen, handover=(2**-5, 2**-4))
    assert again.stage_latency == {"a": [0.5 + 2**-8 + 2**-5, 0.5],
                                   "b": [0.25 + 2**-8 + 2**-5, 0.75]}
    assert again.receive == {"a": [0.0, 2**-4], "b": [0.0, 2**-4]}


def _simple_marks(w: Workload, service: dict) -> list[np.ndarray]:
    """The simple placement's timestamps for trace `w` served without queueing: rank r
    serves model r, each request begins at its arrival."""
    marks = [np.full((len(w), 3), np.nan) for _ in (0, 1)]
    for i, (t, m) in enumerate(zip(w.arrivals, w.model_ids)):
        marks[m][i, :2] = t, t + service[w.models[m]]
    return marks


def test_each_part_is_simulated_with_its_own_service_times_and_with_the_probes_around_it():
    """The check simulates each part with the service times it saw (here constant: 1/4 s for
    a, 1/16 s for b, so exactly as measured); beside it, with the probes' around it: model
    a's probes took 1/8, 1/4 and 3/8 s, so the first part at 3/16 s and the second at 5/16 s;
    b's held still."""
    trace = Workload(("a", "b"), np.array([0.0, 0.5, 1.0, 1.5]), np.array([0, 1, 0, 1]), 2.0)
    parts = [part_of(trace, 0.0, 1.0), part_of(trace, 1.0, 2.0)]
    assert parts[1].arrivals.tolist() == [0.0, 0.5]
    probe = Workload(("a", "b"), np.array([0.0, 0.5]), np.array([0, 1]), 1.0)
    probed = [_simple_marks(probe, {"a": a, "b": 2**-4}) for a in (2**-3, 2**-2, 3 * 2**-3)]
    served = [_simple_marks(p, {"a": a, "b": 2**-4}) for p, a in zip(parts, (0.25, 0.25))]
    cal = {"whole": {"a": 2**-2, "b": 2**-4}, "wake": [0.0, 0.0]}
    slos = {1.0: {"a": 0.25, "b": 1.0}, 0.5: {"a": 0.125, "b": 0.5}}
    out = compare("simple", cal, parts, served, probe, probed, trace, slos,
                   np.ones(4, bool), seed=0)
    assert out["service_probed_by_part_s"] == [{"a": 3 * 2**-4, "b": 2**-4},
                                               {"a": 5 * 2**-4, "b": 2**-4}]
    assert out["simulated_probed_mean_s"] == (3 * 2**-4 + 5 * 2**-4 + 2 * 2**-4) / 4
    assert out["measured_mean_s"] == (2 * 2**-2 + 2 * 2**-4) / 4
    assert out["simulated_mean_s"] == out["measured_mean_s"]
    assert out["simulated_fixed_mean_s"] == out["measured_mean_s"]
    assert out["service_cv_in_run"] == [0.0, 0.0]
    # the second part's a misses its SLO in the probes' simulation only; at half the SLO
    # every a misses
    assert (out["measured_attainment"], out["simulated_probed_attainment"]) == (1.0, 0.75)
    assert out["attainment_by_slo_scale"]["0.5"] == {
        "measured": 0.5, "simulated": 0.5, "simulated_fixed": 0.5, "simulated_probed": 0.5,
        "simulated_alone": 0.5, "simulated_per_request": 0.5}


def test_errors_are_kept_by_profile_the_predictions_apart_from_the_replay():
    run = {"simple": {"measured_mean_s": 0.5, "measured_attainment": 1.0,
                      "simulated_mean_s": 0.5, "simulated_attainment": 1.0,
                      "simulated_probed_mean_s": 0.625, "simulated_probed_attainment": 0.75,
                      "attainment_by_slo_scale": {
                          "5.0": {"measured": 1.0, "simulated": 1.0, "simulated_probed": 0.75},
                          "1.5": {"measured": 0.5, "simulated": 0.25,
                                  "simulated_probed": 0.25}}}}
    e = errors(run)
    assert list(e) == ["probes", "replay"]  # what the run kept, predictions first
    assert e["probes"]["simple"] == {"mean_latency_error_pct": 25.0, "slo_points": 25.0,
                                     "slo_scales": [5.0, 1.5]}
    assert e["replay"]["simple"]["mean_latency_error_pct"] == 0.0
    assert e["replay"]["simple"]["slo_points"] == 25.0  # the largest gap over the scales
    # a JSON of an earlier check names its own keys
    assert errors(run, {"alone": "simulated"})["alone"]["simple"]["slo_scales"] == [5.0, 1.5]


def test_the_check_draws_each_request_s_compute_from_the_part_s_leaving_fixed_costs_alone():
    # model a computed 1/2 s and 3/2 s (mean 1, relative 1/2 and 3/2), b 1/4 s twice
    w = Workload(("a", "b"), np.array([0.0, 5.0, 10.0, 15.0]), np.array([0, 0, 1, 1]), 20.0)
    marks = _simple_marks(w, {"a": 1.0, "b": 0.25})
    marks[0][0, 1], marks[0][1, 1] = 0.5, 6.5
    seen = {"a": 1.0, "b": 0.25}
    cal = {"wake": [1.0, 0.0]}  # a's stage: 1 s of wake-up, then 1 s of compute
    groups = sim_groups("simple", cal, seen)
    (draws,) = spread_draws("simple", marks, w, groups, seen, np.random.default_rng(0))
    # a's multiple of its 2 s: (1 + 1/2) / 2 or (1 + 3/2) / 2; b's computes are all equal
    assert set(draws[:2, 0]) <= {0.75, 1.25}
    assert draws[2:, 0].tolist() == [1.0, 1.0]
    many = spread_draws("simple", marks, w, groups, seen, np.random.default_rng(1),
                        count=20).reshape(-1, 2)
    assert set(many[:, 0]) == {0.75, 1.0, 1.25}


def test_a_pipelined_request_s_time_splits_into_parts_that_sum_to_its_latency():
    # three requests, timestamps as the ranks write them (s); the third finds stage 2 busy
    w = Workload(("a", "b"), np.array([0.0, 0.1, 0.11]), np.array([0, 1, 0]), 1.0)
    nan = np.nan
    first = np.array([[0.001, 0.011, nan], [0.101, 0.111, nan], [0.12, 0.13, nan]])
    second = np.array([[0.0, 0.0125, 0.0325],  # posted, received, end
                       [0.0325, 0.1125, 0.1325],
                       [0.1325, 0.1345, 0.1545]])
    counted = np.ones(3, bool)
    b = breakdown([first, second], w, counted)
    assert b["to_first_stage"] == pytest.approx((0.001 + 0.001 + 0.01) / 3)
    assert b["first_compute"] == pytest.approx(0.01)
    assert b["wait_for_receive"] == pytest.approx(0.0025 / 3)
    assert b["handover_second_idle"] == pytest.approx(0.0015)
    assert b["handover_second_busy"] == pytest.approx(0.002)
    assert b["second_busy_share"] == pytest.approx(1 / 3)
    assert b["second_compute"] == pytest.approx(0.02)
    parts = ("to_first_stage", "first_compute", "wait_for_receive", "handover",
             "second_compute")
    latency = finish_times("pipeline", [first, second]) - w.arrivals
    assert sum(b[k] for k in parts) == pytest.approx(latency.mean())
    # the simulator with each request's own computes: the idle first request pays wake-up,
    # its compute, the send and the second compute; the third's input (ready at 0.125) is held
    # until stage 2 frees at 0.1325, received in 0.002, and computed in 0.02: as measured
    cal = {"wake": [0.001, 0.0], "send": 0.0015, "receive": 0.002}
    own = per_request("pipeline", [first, second], w, cal, None, 0.0)
    assert own.latency[0] == pytest.approx(0.001 + 0.01 + 0.0015 + 0.02)
    assert own.finish[2] == pytest.approx(0.1325 + 0.002 + 0.02)
    assert own.latency[2] == pytest.approx(latency[2])


@pytest.mark.slow
def test_both_placements_serve_the_trace_on_two_processes(tmp_path):
    from graphpar.placement.real_check import real_check

    r = real_check(rate=8.0, duration=8.0, warmup=1.0, repeats=5, segments=2, probe=2.0,
                   keep=tmp_path / "marks.npz")
    kept = np.load(tmp_path / "marks.npz")
    # every replay's timestamps: 2 parts and 3 probes per placement, per rank
    assert sum(k.startswith("served_pipeline") for k in kept.files) == 2 * 2
    assert sum(k.startswith("probed_simple") for k in kept.files) == 3 * 2
    assert len(kept["part0_arrivals"]) + len(kept["part1_arrivals"]) == r["requests"]
    fastest = min(r["service_s"]["whole"].values())
    for mode in ("simple", "pipeline"):
        for key in ("measured_mean_s", "simulated_mean_s", "simulated_alone_mean_s",
                    "simulated_fixed_mean_s", "simulated_probed_mean_s",
                    "simulated_per_request_mean_s"):
            assert r[mode][key] >= 0.5 * fastest  # all finished (NaN fails this)
        assert 0.0 <= r[mode]["measured_attainment"] <= 1.0
    b = r["pipeline"]["breakdown_s"]
    parts = ("to_first_stage", "first_compute", "wait_for_receive", "handover",
             "second_compute")
    assert sum(b[k] for k in parts) == pytest.approx(r["pipeline"]["measured_mean_s"])
    assert r["service_s"]["receive"] > 0


BENCH = Path(__file__).parents[2] / "tools" / "bench"


@pytest.mark.slow
@pytest.mark.parametrize("kept", ["placement_real.json", "placement_real.seg6.json"])
def test_the_simulator_predicts_mean_latency_within_25_percent_from_probes(kept):
    """The predictive error, not the replay's: the simulator given the mean service times of
    probes served in the seconds around each part (not the requests it is checked on) against
    the measured mean latency, in the idle-machine runs the bench kept (2 cores of an AMD
    EPYC, utilisation 0.4, 60 s per run; `tools/bench/placement_real.py`).

    Why 25 %: over the 8 idle runs of docs/placement.md (16 placements) the probes' error
    ranged from -20.5 % (a pipeline whose machine slowed inside a part) to +11.3 %, 12 of 16
    within 10 %; 25 % bounds all of them with a margin for a new run's drift. SLO attainment
    was off by up to 9.3 points: bounded by 10. The kept runs are 4 of the 8 (-7.7 to
    +11.3 %); the others' JSON was rewritten (their timestamps were re-simulated for the
    table). Slow-marked: it tests kept measurements, which a rerun of the bench on a busy
    machine replaces (under load, each process's profile alone was 14-48 % short:
    placement_real.load.json), not the code; a rerun that breaks it means the docs' predictive
    figures must change."""
    results = json.loads((BENCH / kept).read_text())
    profiles = {name: p["key"] for name, p in results["profiles"].items()}
    assert results["runs"]
    for run in results["runs"]:
        e = errors(run, profiles)
        assert run["errors"] == e  # the JSON's summary is its numbers'
        for mode in ("simple", "pipeline"):
            assert abs(e["probes"][mode]["mean_latency_error_pct"]) <= 25.0, (run["seed"], mode)
            assert e["probes"][mode]["slo_points"] <= 10.0, (run["seed"], mode)
            # a profile of each process alone, before the run, is short: the models ran
            # slower in the run than alone (docs/placement.md: 8-42 % over the 8 runs)
            assert -45.0 <= e["alone"][mode]["mean_latency_error_pct"] < 0.0


@pytest.mark.parametrize("bad", [dict(segments=0), dict(probe=0.0), dict(duration=0.0)])
def test_a_check_without_parts_probes_or_trace_is_refused_before_any_process_starts(bad):
    from graphpar.errors import UsageError
    from graphpar.placement.real_check import real_check

    with pytest.raises(UsageError, match="at least one part and a probe"):
        real_check(rate=8.0, **bad)


def test_a_rank_s_speed_is_the_mean_of_its_other_computes_close_in_time():
    # requests began at 0, 0.25, 0.5 and 3 s, computing 1, 2, 3 and 5 times their means: the
    # first three are within 0.5 s of each other (the first and the third just), the last
    # alone; the second-rank timestamps are unused in the simple placement
    nan = np.nan
    begin = np.array([0.0, 0.25, 0.5, 3.0])
    marks = [np.column_stack([begin, begin + 1, np.full(4, nan)]), np.full((4, 3), nan)]
    rel = np.array([1.0, 2.0, 3.0, 5.0])
    assert speed_around("simple", marks, rel, 0).tolist() == [2.5, 2.0, 1.5, 1.0]
    # a request the rank did not serve has no speed, and counts for no one
    rel[1] = nan
    assert speed_around("simple", marks, rel, 0, width=0.5)[[0, 2, 3]].tolist() == [3.0, 1.0, 1.0]
    assert np.isnan(speed_around("simple", marks, rel, 0)[1])
