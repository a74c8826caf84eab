"""The plan-quality benchmark: its rank correlation and noise rule, and (slow) a run on gloo
ranks that writes its JSON (timings are not asserted)."""

import json

import pytest


def test_kendall_tau_b_matches_known_values(load_bench):
    tau = load_bench("plan_quality").kendall_tau
    assert tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / 6**0.5)  # tau-b with a tie (scipy)
    assert tau([1], [2]) is None and tau([1, 1], [1, 2]) is None


def _row(plan, predicted, measured, noise=0.0, cpu=1.0):
    return {"model": "gpt", "mode": "train", "mesh": "2", "plan": plan, "status": "ok",
            "predicted_ms": predicted, "measured_ms": measured, "noise": noise,
            "measured_cpu_ms": cpu, "cpu_noise": 0.0,
            "relative_error": (predicted - measured) / measured}


def test_the_ilp_plan_counts_as_fastest_only_within_the_measured_noise(load_bench):
    summarize = load_bench("plan_quality").summarize
    rows = [_row("ilp", 1.0, 11.0, noise=0.05, cpu=3.0),
            _row("data", 2.0, 10.0, noise=0.02, cpu=4.0),
            {"model": "gpt", "mode": "train", "mesh": "2", "plan": "zero-3",
             "status": "does not fit in memory"}]
    group = summarize(rows)["gpt/train/2"]
    assert group["plans"] == 2 and group["fastest"] == "data"
    assert group["kendall_tau"] == -1.0
    assert group["ilp_fastest_or_within_noise"] is False  # 11 > 10 * 1.05
    # by CPU time the ILP plan is the fastest, and the orders agree
    assert group["fastest_cpu"] == "ilp" and group["kendall_tau_cpu"] == 1.0
    assert group["ilp_fastest_or_within_noise_cpu"] is True
    rows[0]["noise"] = 0.10
    assert summarize(rows)["gpt/train/2"]["ilp_fastest_or_within_noise"] is True
    assert group["median_abs_relative_error"] == pytest.approx((10 / 11 + 0.8) / 2)


def test_a_mesh_is_priced_on_this_machine_calibrated_on_as_many_ranks(load_bench, tmp_path,
                                                                     monkeypatch):
    bench = load_bench("plan_quality")
    monkeypatch.setattr(bench, "DEFAULT_CLUSTER", str(tmp_path / "gloo_cluster.json"))
    assert bench.cluster_for(4, None) == bench.DEFAULT_CLUSTER  # no 4-rank file: the 2-rank
    (tmp_path / "gloo_cluster.4ranks.json").write_text("{}")
    assert bench.cluster_for(4, None) == str(tmp_path / "gloo_cluster.4ranks.json")
    assert bench.cluster_for(2, None) == bench.DEFAULT_CLUSTER
    assert bench.cluster_for(4, "dgx-a100") == "dgx-a100"


def test_a_programs_estimate_is_its_nodes_priced():
    """`plan_runs.node_rows` prices every node of the device program the way the cost model
    does (compute: roofline; collectives: alpha-beta); their sum is the program's estimate,
    near the plan's objective (which prices the copies inside a reshard at 0, and a value
    resharded for two readers twice)."""
    from graphpar.calibration.plan_runs import capture_case, node_rows, program_seconds, solve_plan
    from graphpar.cost.cluster import get_cluster, mesh_for

    case = capture_case("gpt", "infer", batch=2, config=dict(n_layers=1))
    mesh = mesh_for("2", get_cluster("cpu"))
    plan, compiled = solve_plan(case, mesh, "megatron", time_limit=10)
    rows = node_rows(compiled)
    assert len(rows) == len(compiled.spmd.nodes) and all(r.measured == 0 for r in rows)
    assert {r.kind for r in rows if r.collective} == {"all_gather", "reduce_scatter"}
    assert all(r.group == 2 for r in rows if r.collective)
    assert program_seconds(compiled) == pytest.approx(sum(r.predicted for r in rows))
    assert program_seconds(compiled) == pytest.approx(plan.step_seconds, rel=0.2)


@pytest.mark.slow
def test_plan_quality_bench_runs_plans_on_gloo_ranks(load_bench, tmp_path, capsys):
    bench = load_bench("plan_quality")
    out = tmp_path / "plan_quality.json"
    result = bench.main(["--models", "gpt", "--modes", "decode", "--meshes", "2",
                         "--plans", "ilp", "megatron", "data+megatron", "--steps", "2",
                         "--warmup", "0", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = {r["plan"]: r for r in result["rows"]}
    assert list(rows) == ["ilp", "megatron", "data+megatron"]
    assert rows["data+megatron"]["status"].startswith("n/a: data x tensor parallelism")
    for plan in ("ilp", "megatron"):
        r = rows[plan]
        assert r["status"] == "ok" and r["predicted_ms"] > 0 and r["measured_ms"] > 0
        assert r["measured_min_ms"] <= r["measured_ms"]
        assert len(r["measured_repeat_medians_ms"]) == 1
    # the ILP never does worse than a hand plan under its objective (but the memory tie-break)
    assert rows["ilp"]["objective_ms"] <= rows["megatron"]["objective_ms"] * (1 + 1e-3)
    assert result["groups"]["gpt/decode/2"]["plans"] == 2
    assert "gpt/decode/2" in capsys.readouterr().out
