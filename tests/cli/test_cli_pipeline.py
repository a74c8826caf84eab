"""`graphpar compile --pipeline`: stages sliced by the DP, the MPMD program written, one
pipelined step run on CPU ranks equal to eager, and clear errors for impossible requests."""

import json

import pytest
from cli_run import run_cli

from graphpar.ir.parser import parse_program


def test_two_stage_mlp_runs_on_two_ranks_equal_to_eager(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    code, out, err = run_cli(capsys, "compile", "--example", "mlp", "--mode", "train",
                             "--mesh", "2", "--cluster", "cpu", "--pipeline", "2",
                             "--microbatches", "2", "--schedule", "zb", "--run-cpu", "2",
                             "--trace", trace, "--lower", "cuda", "--out", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    pipe = report["pipeline"]
    assert len(pipe["stages"]) == 2 and pipe["schedule"] == "zb" and pipe["microbatches"] == 2
    assert [s["devices"] for s in pipe["stages"]] == [[0], [1]]
    run = report["run_cpu"]
    assert run["errors"] and all(e["tolerance_used"] <= 1 for e in run["errors"].values()), (
        run["error_lines"])
    assert run["bytes_between_stages_logical"] == run["bytes_between_stages_predicted"] > 0
    assert run["bytes_between_stages_counted"] >= run["bytes_between_stages_logical"]
    # the step timed after the checked one, beside the simulated schedule's estimate, and
    # each stage's forward + backward per microbatch beside the stage's estimate
    assert run["steps"] == 5 and len(run["step_seconds_each"]) == 5
    assert run["step_seconds_estimated"] == pipe["schedule_step_seconds_estimated"]
    assert run["step_time_ratio"] == pytest.approx(
        run["step_seconds_measured"] / run["step_seconds_estimated"])
    assert [s["seconds_per_microbatch_estimated"] for s in run["stages"]] == [
        s["seconds_per_microbatch_estimated"] for s in pipe["stages"]]
    assert all(0 < s["seconds_per_microbatch_measured"] < run["step_seconds_measured"]
               for s in run["stages"])
    assert "ms estimated, ratio" in out and "stage 1: forward + backward" in out
    ir_file = next(f for f in report["files"] if f.endswith(".gpir"))
    program = parse_program((tmp_path / "out" / ir_file).read_text())
    names = [g.name for g in program]
    assert {"stage0_forward", "stage1_forward", "stage0_backward", "stage1_backward"} <= set(
        names)
    for g in program:  # each stage graph carries its stage's estimates, for graphpar viz
        stage = pipe["stages"][int(g.name[len("stage")])]
        assert g.attrs == {"est_seconds": stage["seconds_per_microbatch_estimated"],
                           "mem_bytes": stage["memory_bytes_per_device_estimated"]}
    # --lower cuda: every stage program's listing, sends and receives as NCCL calls
    cuda = report["cuda"]
    assert set(cuda) == set(names)
    assert cuda["stage0_forward"]["calls_by_kind_rank0"].get("nccl.send", 0) > 0
    assert cuda["stage1_forward"]["calls_by_kind_rank0"].get("nccl.recv", 0) > 0
    assert all(c["arena_bytes_planned"][0] >= c["arena_lower_bound_bytes"][0] for c in
               cuda.values())
    assert (tmp_path / "out" / "cuda" / "stage1_backward" / "rank0.calls").read_text(
        ).startswith("listing @stage1_backward rank=0")
    assert json.loads(trace.read_text())["traceEvents"]
    assert "2 stages, 2 microbatches, schedule zb" in out


@pytest.mark.parametrize("argv, says", [
    (["--pipeline", "2", "--microbatches", "3"], "--microbatches 3: the batch of 2 cannot be "
                                                 "cut into 3 equal microbatches"),
    (["--pipeline", "9", "--microbatches", "2"], "--pipeline 9: more stages than the 2 devices "
                                                 "of --mesh 2"),
    (["--pipeline", "2", "--microbatches", "1", "--schedule", "1f1b"],
     "needs at least as many microbatches as stages"),
    (["--pipeline", "2", "--microbatches", "2", "--memory-limit", "1KB"],
     "the leanest one needs about"),
    (["--pipeline", "2", "--microbatches", "2", "--memory-limit", "1KB"],
     "a larger --memory-limit (slice-stages{memory_limit=...} when the pass is given in "
     "--passes), or more, smaller --microbatches"),
])
def test_impossible_pipelines_are_refused_with_what_to_change(tmp_path, capsys, argv, says):
    code, out, err = run_cli(capsys, "compile", "--example", "mlp", "--mode", "train",
                             "--mesh", "2", "--cluster", "cpu", *argv,
                             "--out", tmp_path / "out")
    assert code != 0
    assert says in err, err
    assert not (tmp_path / "out").exists()


def test_without_microbatches_a_step_is_cut_into_4_or_the_most_that_divide_the_batch(
        tmp_path, capsys):
    from graphpar.cli.pipeline import default_microbatches

    assert [default_microbatches(b) for b in (1, 2, 3, 4, 6, 8, 9, 16)] == [
        1, 2, 3, 4, 3, 4, 3, 4]
    # the mlp example's batch is 2: 2 microbatches, not an error about 4
    code, out, err = run_cli(capsys, "compile", "--example", "mlp", "--mode", "train",
                             "--mesh", "2", "--cluster", "cpu", "--pipeline", "2",
                             "--schedule", "gpipe", "--out", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["pipeline"]["microbatches"] == 2
    # every layer ILP solve of the stage search counted, and here all proven optimal
    solves = report["pipeline"]["layer_solves"]
    assert solves["counted"] == solves["optimal"] == report["pipeline"]["ilp_solves"] > 0
    assert solves["warning"] is None and solves["examples"] == []
    assert f"ILP solves (counted): {solves['counted']} optimal" in out
    assert "warning" not in out


def test_layer_solves_that_hit_the_time_limit_are_reported_with_one_warning_line(
        tmp_path, capsys, monkeypatch):
    from graphpar.errors import TimeLimitError
    from graphpar.passes.autoshard.ilp import Reduced
    from graphpar.passes.pipeline import slice_stages

    # On mesh 2 the layers are solved on logical meshes 1x1, 2x1 and 1x2: on 2x1 every solve
    # stops at the time limit with a plan not proven optimal, on 1x2 before any plan.
    original, seen = Reduced.solve, []

    def solve(self, memory_limit=None, time_limit=30.0, *args, **kwargs):
        shape = tuple(self.problem.mesh.shape)
        seen.append((shape, time_limit))
        if shape == (1, 2):
            raise TimeLimitError(f"the sharding ILP found no plan (UNKNOWN) within the "
                                 f"{time_limit:.3g} s it had")
        plan = original(self, memory_limit, time_limit, *args, **kwargs)
        if shape == (2, 1):
            plan.stats.update(status="FEASIBLE", optimality_gap=0.5)
        return plan

    monkeypatch.setattr(Reduced, "solve", solve)
    # the layer solves run in this process, where `seen` is recorded
    monkeypatch.setattr(slice_stages, "available_workers", lambda: 1)
    code, out, err = run_cli(capsys, "compile", "--example", "mlp", "--mode", "train",
                             "--mesh", "2", "--cluster", "cpu", "--pipeline", "2",
                             "--microbatches", "2", "--time-limit", "0.5",
                             "--out", tmp_path / "out")
    assert code == 0, err
    assert {t for _, t in seen} == {0.5}  # --time-limit is each layer solve's
    shapes = [shape for shape, _ in seen]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    solves = report["pipeline"]["layer_solves"]
    assert {k: solves[k] for k in ("counted", "optimal", "time_limit_not_proven_optimal",
                                   "time_limit_no_plan", "infeasible", "failed")} == {
        "counted": len(shapes), "optimal": shapes.count((1, 1)),
        "time_limit_not_proven_optimal": shapes.count((2, 1)),
        "time_limit_no_plan": shapes.count((1, 2)), "infeasible": 0, "failed": 0}
    assert solves["counted"] == report["pipeline"]["ilp_solves"]
    assert solves["no_plan_on"] == ["1x2"]
    example = next(e for e in solves["examples"] if e["outcome"] == "time_limit_no_plan")
    assert example["logical_mesh"] == example["submesh"] == "1x2" and example["modules"]
    assert "within the 0.5 s it had" in example["message"]
    warnings = [line for line in out.splitlines() if "warning" in line]
    assert warnings == [
        f"  warning    stage search: {shapes.count((2, 1))} hit the time limit with a plan "
        f"not proven optimal (kept), {shapes.count((1, 2))} hit the time limit before any "
        f"plan, of {len(shapes)} layer ILP solves (counted); logical mesh 1x2 left out of "
        f"every layering with those layers (examples: {tmp_path / 'out' / 'report.json'}, "
        "pipeline.layer_solves)"]


def test_a_stage_search_whose_every_solve_ran_out_of_time_exits_1(tmp_path, capsys,
                                                                   monkeypatch):
    from graphpar.errors import TimeLimitError
    from graphpar.passes.autoshard.ilp import Reduced

    def solve(self, memory_limit=None, time_limit=30.0, *args, **kwargs):
        raise TimeLimitError(f"the sharding ILP found no plan (UNKNOWN) within the "
                             f"{time_limit:.3g} s it had")

    monkeypatch.setattr(Reduced, "solve", solve)
    code, out, err = run_cli(capsys, "compile", "--example", "mlp", "--mode", "train",
                             "--mesh", "2", "--cluster", "cpu", "--pipeline", "auto",
                             "--microbatches", "2", "--time-limit", "0.01",
                             "--out", tmp_path / "out")
    assert code == 1
    assert "no stage could be priced: every one of the" in err
    assert "hit the time limit of 0.01 s before any plan; raise --time-limit" in err
    assert not (tmp_path / "out").exists()


def test_the_users_limits_reach_every_stage_ilp(tmp_path, capsys, ilp_limits):
    # One stage on both devices: the stage search solves each layer with --time-limit (its DP
    # holds the stage to --memory-limit), and --run-cpu re-solves each of the stage's phases
    # on its logical mesh under both limits, not the device's memory and a fixed 10 s.
    from graphpar.cost.limits import PlanLimits

    code, out, err = run_cli(capsys, "compile", "--example", "mlp", "--mode", "train",
                             "--mesh", "2", "--cluster", "cpu", "--pipeline", "1",
                             "--microbatches", "2", "--memory-limit", "3GB",
                             "--time-limit", "7", "--run-cpu", "2", "--run-cpu-steps", "1",
                             "--out", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (stage,) = report["pipeline"]["stages"]
    assert stage["memory_bytes_per_device_estimated"] <= 3e9
    logical = tuple(int(n) for n in stage["logical_mesh"].split("x"))
    assert ilp_limits["layers"] and set(ilp_limits["layers"]) == {(None, 7.0)}
    # the stage's phases (forward, backward, update at least), each re-solved on its mesh
    assert len(ilp_limits["plans"]) >= 3
    assert set(ilp_limits["plans"]) == {(logical, PlanLimits(3e9, 7.0))}
    assert report["run_cpu"]["within_tolerance"], report["run_cpu"]["error_lines"]
