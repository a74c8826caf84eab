"""The schedule benchmark script runs and writes its JSON."""

import json

import pytest


def test_schedule_bench_writes_its_tables(load_bench, tmp_path, capsys):
    bench = load_bench("schedules")
    out = tmp_path / "schedules.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    one_f_one_b = [r for r in result["bubbles"] if r["schedule"] == "1f1b"]
    assert len(one_f_one_b) == 8  # p in (2, 4) x m in (p, 2p, 4p, 8p)
    for row in one_f_one_b:
        assert row["bubble_fraction"] == pytest.approx(
            row["formula_p_minus_1_over_m_plus_p_minus_1"], rel=1e-12
        )
    assert {r["schedule"] for r in result["eq2"]} == {"gpipe", "1f1b"}
    assert [r["schedule"] for r in result["timings"]] == ["gpipe", "1f1b", "zb"]
    assert "Simulated step / Alpa Eq. 2" in capsys.readouterr().out
