"""The placement benchmark's fast part runs and writes the paper's §3.1 and Fig. 10 numbers."""

import json

import pytest


def test_placement_bench_writes_section_3_1_and_fig10(load_bench, tmp_path, capsys):
    bench = load_bench("placement")
    out = tmp_path / "placement.json"
    assert bench.main(["--settings", "", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    cv1 = result["section_3_1"]["cv1"]
    assert cv1["formula_simple_s"] == pytest.approx(0.70)
    assert cv1["formula_pipeline_s"] == pytest.approx(0.55)
    assert cv1["simple_s"] == pytest.approx(0.70, rel=0.03)
    assert cv1["pipeline_s"] == pytest.approx(0.55, rel=0.03)
    assert result["section_3_1"]["cv3"]["speedup"] > 1.5
    assert [r["u"] for r in result["fig10"]][0] == 0.01
    assert result["simulator"]["requests_per_cpu_second"] > 0
    assert "Fig. 10" in capsys.readouterr().out


def test_placement_real_bench_sums_up_a_kept_json_s_errors_by_profile(load_bench, tmp_path,
                                                                     capsys):
    """--errors runs nothing: it adds each run's errors by profile to a kept JSON, by the
    profiles that JSON names (an earlier check's keys), and prints the predictions first."""
    bench = load_bench("placement_real")
    kept = tmp_path / "placement_real.json"
    kept.write_text(json.dumps({"profiles": {
        "probes": {"key": "simulated", "what": "the probes"},
        "replay": {"key": "simulated_window", "what": "the run's own"}},
        "runs": [{"seed": 0, "simple": {"measured_mean_s": 0.04, "measured_attainment": 0.9,
                                        "simulated_mean_s": 0.05, "simulated_attainment": 1.0,
                                        "simulated_window_mean_s": 0.04,
                                        "simulated_window_attainment": 0.9}}]}))
    assert bench.main(["--errors", str(kept)]) == 0
    [run] = json.loads(kept.read_text())["runs"]
    assert list(run["errors"]) == ["probes", "replay"]
    assert run["errors"]["probes"]["simple"]["mean_latency_error_pct"] == pytest.approx(25.0)
    assert run["errors"]["probes"]["simple"]["slo_points"] == pytest.approx(10.0)
    assert run["errors"]["replay"]["simple"]["mean_latency_error_pct"] == 0.0
    out = capsys.readouterr().out
    assert out.index("probes") < out.index("replay")


@pytest.mark.slow
def test_placement_real_bench_replays_through_graphpar_serve(load_bench, tmp_path, capsys):
    """--server: the trace goes through `graphpar serve --placement` over HTTP (every request
    answered, or the replay raises), measured and simulated side by side."""
    pytest.importorskip("httpx2")
    bench = load_bench("placement_real")
    out = tmp_path / "server.json"
    assert bench.main(["--server", "--duration", "4", "--runs", "1", "--rate", "5",
                       "--out", str(out)]) == 0
    policies = json.loads(out.read_text())["policies"]
    for name in ("simple", "pipeline"):
        [run] = policies[name]["runs"]
        assert run["requests"] > 0 and run["measured_mean_s"] > 0 and run["simulated_mean_s"] > 0
        assert set(policies[name]["service_alone_s"]) == {"gpt", "llama"}
        assert set(run["attainment_by_slo_scale"]) == {"1.5", "2.0", "3.0", "5.0"}
    assert "simulated_as_served_mean_s" in policies["pipeline"]["runs"][0]
    printed = capsys.readouterr().out
    assert "simple, run 0" in printed and "pipeline, run 0" in printed
