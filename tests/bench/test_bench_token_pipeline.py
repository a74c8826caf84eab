"""The token-pipeline benchmark runs end to end on its quick setting: every slicing and
schedule equals eager and sends the bytes its programs predict."""

import json

import pytest


@pytest.mark.slow
def test_token_pipeline_bench_quick(load_bench, tmp_path, capsys):
    bench = load_bench("token_pipeline")
    out = tmp_path / "token_pipeline.json"
    rows = bench.main(["--quick", "--slicings", "8;5,2,1", "--schedules", "1f1b",
                       "--out", str(out)])
    assert [r["token_slices"] for r in rows] == [[8], [5, 2, 1]]
    assert all(r["equal_to_eager"] for r in rows)
    assert all(r["bytes_between_stages_measured"] == r["bytes_between_stages_predicted"] > 0
               for r in rows)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert "(estimated)" in capsys.readouterr().out
