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
    (["--pipeline", "2", "--microbatches", "3"], "--microbatches 3: input 'input 0' of shape"),
    (["--pipeline", "9", "--microbatches", "2"], "stages=9 is more than the"),
    (["--pipeline", "2", "--microbatches", "1", "--schedule", "1f1b"],
     "needs at least as many microbatches as stages"),
    (["--pipeline", "2", "--microbatches", "2", "--memory-limit", "1KB"],
     "the leanest one needs about"),
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
