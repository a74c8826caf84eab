"""The capture benchmark script runs and writes its JSON (numbers are not asserted here)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "tools" / "bench" / "capture.py"


def test_capture_bench_writes_rows(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_capture", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "capture.json"
    assert bench.main(["--models", "mlp:tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["model"], r["mode"]) for r in result["rows"]] == [("mlp:tiny", "infer"),
                                                                ("mlp:tiny", "train")]
    assert result["rows"][0]["nodes"] == 5
    assert "capture s" in capsys.readouterr().out
