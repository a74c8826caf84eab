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
