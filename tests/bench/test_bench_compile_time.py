"""The compile-time benchmark runs a row in a fresh process and writes its phases and peak
memory (the numbers are measured, so only their consistency is asserted)."""

import json

import pytest


@pytest.mark.slow
def test_compile_time_bench_writes_a_row_per_model_and_mesh(load_bench, tmp_path, capsys):
    bench = load_bench("compile_time")
    out = tmp_path / "compile_time.json"
    assert bench.main(["--models", "gpt:tiny", "--meshes", "1x2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert (row["model"], row["mesh"], row["mode"], row["solver_status"]) == (
        "gpt:tiny", "1x2", "infer", "OPTIMAL")
    assert set(row["wall_s"]) == {*bench.PHASES, "total"}
    assert abs(sum(row["wall_s"][p] for p in bench.PHASES) - row["wall_s"]["total"]) < 0.01
    assert 0 <= row["solve_s"] <= row["wall_s"]["auto_shard"]
    assert 0 < row["peak_rss_gib"] < 4
    assert result["alpa_table5_gpt39b_64gpu_s"]["total"] == 2393.26
    assert "RSS GiB" in capsys.readouterr().out
    # the CLI's plan limits unless told otherwise, kept with the row
    assert (row["cluster"], row["memory_limit"], row["via"]) == ("dgx-a100", "device", "phases")
    assert row["time_limit_s"] == 30.0 and row["cpu"] and row["cpu_count"] >= 1
    # the command itself, added beside the row; a row of the same settings is replaced
    for _ in range(2):
        assert bench.main(["--models", "gpt:tiny", "--meshes", "1x2", "--via", "cli",
                           "--out", str(out), "--update"]) == 0
    phases, cli = json.loads(out.read_text())["rows"]
    assert phases == row
    assert cli["via"] == "cli" and cli["exit_status"] == 0
    assert cli["command"].startswith("graphpar compile --example gpt:tiny --mode infer --mesh 1x2")
    assert (cli["step_ms_estimated"], cli["ilp_variables"]) == (
        row["step_ms_estimated"], row["ilp_variables"])
    assert 0 < cli["peak_rss_gib"] < 4 and cli["cpu_s"]["total"] > 0


@pytest.mark.slow
def test_a_row_the_memory_limit_refuses_says_so_with_its_times(load_bench, tmp_path):
    bench = load_bench("compile_time")
    out = tmp_path / "compile_time.json"
    assert bench.main(["--models", "gpt:tiny", "--meshes", "1x2", "--memory-limit", "1KB",
                       "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert "no plan fits" in row["refused"] and row["memory_limit"] == "1KB"
    assert "step_ms_estimated" not in row and row["wall_s"]["auto_shard"] >= 0
