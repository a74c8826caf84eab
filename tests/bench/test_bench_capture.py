"""The capture benchmark script runs and writes its JSON (numbers are not asserted here)."""

import json


def test_capture_bench_writes_rows(load_bench, tmp_path, capsys):
    bench = load_bench("capture")
    out = tmp_path / "capture.json"
    assert bench.main(["--models", "mlp:tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["model"], r["mode"]) for r in result["rows"]] == [("mlp:tiny", "infer"),
                                                                ("mlp:tiny", "train")]
    assert result["rows"][0]["nodes"] == 5
    assert "capture s" in capsys.readouterr().out
