"""The pipeline runtime benchmark runs on sub-meshes, one process per device, and its byte
columns agree: tiles cross once (measured = predicted, less than naive), and the local
all-gathers send what the cost model says."""

import json

import pytest


@pytest.mark.slow
def test_pipeline_runtime_bench_on_a_sharded_stage(load_bench, tmp_path, capsys):
    bench = load_bench("pipeline_runtime")
    out = tmp_path / "cross_mesh.json"
    assert bench.main(["--quick", "--submeshes", "1,1x2", "--microbatches", "4",
                       "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["devices"] == [1, 2] and row["equal_to_eager"]
    assert row["bytes_between_stages_measured"] == row["bytes_between_stages_predicted"]
    assert row["bytes_between_stages_measured"] < row["bytes_across_naive"]
    assert row["bytes_gathered_inside_measured"] == row["bytes_gathered_inside_predicted"] > 0
    assert "across meas." in capsys.readouterr().out
