"""The serving benchmark script runs and writes its JSON (numbers are not asserted here)."""

import json

import pytest


@pytest.mark.slow
def test_serve_bench_writes_rows(load_bench, tmp_path, capsys):
    bench = load_bench("serve")
    out = tmp_path / "serve.json"
    assert bench.main(["--models", "gpt:tiny", "--batch", "2", "--requests", "4",
                       "--repeat", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["system"], r["batch"]) for r in result["rows"]] == [("naive", 2), ("engine", 2)]
    assert all(r["same_tokens"] for r in result["rows"])
    assert "tok/s" in capsys.readouterr().out
