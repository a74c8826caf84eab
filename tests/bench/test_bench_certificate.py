"""The certificate benchmark runs and writes its JSON: a correct plan within its bound, the
planted collective bug beyond it and located."""

import json


def test_certificate_bench_writes_rows(load_bench, tmp_path, capsys):
    bench = load_bench("certificate")
    out = tmp_path / "certificate.json"
    assert bench.main(["--cases", "gpt:tiny", "--steps", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["collectives"] > 0
    assert row["clean_passes"] and row["clean_tolerance_used"] <= 1
    assert row["planted_fails"] and row["planted_first_difference"].startswith("%")
    assert "first difference" in capsys.readouterr().out
