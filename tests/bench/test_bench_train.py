"""tools/bench/train.py: graphpar's plan, DDP and FSDP2 each train and are timed, and the JSON
holds what the table prints (timings themselves are not asserted)."""

import json

import pytest


@pytest.mark.slow
def test_every_contender_trains_and_is_timed(load_bench, tmp_path, capsys):
    bench = load_bench("train")
    out = tmp_path / "train.json"
    assert bench.main(["--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["contender"] for r in result["rows"]] == ["graphpar", "ddp", "fsdp2"]
    for row in result["rows"]:
        assert len(row["seconds"]) == 2 and row["step_seconds_median_measured"] > 0
    assert result["rows"][0]["estimated_seconds"] > 0
    assert result["tokens_per_step"] == 64 and "step ms (median)" in capsys.readouterr().out
