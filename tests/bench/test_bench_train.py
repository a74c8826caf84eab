"""tools/bench/train.py: graphpar's plans (auto-shard's, the data and DDP hand plans, a
pipelined one), DDP and FSDP2 each train and are timed, and the JSON holds what the table
prints (timings themselves are not asserted)."""

import json

import pytest


def test_ddp_and_pipelined_contenders_train_as_graphpar_train_runs_them(load_bench, tmp_path):
    bench = load_bench("train")
    out = tmp_path / "train.json"
    assert bench.main(["--only", "graphpar-ddp,graphpar-pipeline", "--steps", "1",
                       "--warmup", "0", "--rounds", "1", "--out", str(out)]) == 0
    rows = {r["contender"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["graphpar-ddp", "graphpar-pipeline"]
    # DDP's plan: every gradient all-reduced once, and the loss's sum and count (counted);
    # bucketed, two: the loss's two scalars, and every gradient (gpt:tiny's 0.5 MB) in one
    ddp = rows["graphpar-ddp"]
    assert (ddp["collectives_in_program"], ddp["collectives_run_bucketed"]) == (31, 2)
    pipe = rows["graphpar-pipeline"]
    assert pipe["pipeline"]["devices"] == [[0], [1]] and pipe["pipeline"]["microbatches"] == 2
    for row in rows.values():
        assert "error" not in row and row["step_seconds_median_measured"] > 0
        assert row["estimated_seconds"] > 0


@pytest.mark.slow
def test_every_contender_trains_and_is_timed(load_bench, tmp_path, capsys):
    bench = load_bench("train")
    out = tmp_path / "train.json"
    assert bench.main(["--steps", "2", "--warmup", "1", "--rounds", "1",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cluster"] == "cpu-gloo"
    assert [r["contender"] for r in result["rows"]] == list(bench.CONTENDERS)
    for row in result["rows"]:
        if row["contender"] == "fsdp2" and "error" in row:  # FSDP2 may not run on CPU
            continue
        assert len(row["rounds"][0]["seconds"]) == 2 and row["step_seconds_median_measured"] > 0
    assert result["rows"][0]["estimated_seconds"] > 0
    assert result["tokens_per_step"] == 64 and "step ms (median)" in capsys.readouterr().out
