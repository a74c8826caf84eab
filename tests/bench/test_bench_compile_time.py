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
