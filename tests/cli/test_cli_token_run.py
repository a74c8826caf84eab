"""`graphpar compile --pipeline ... --run-cpu N --token-slices S`: the pipelined step run token
slice by token slice on CPU ranks, equal to eager, and clear errors for what it cannot run."""

import json

import pytest
from cli_run import run_cli

PIPELINE = ["--mode", "train", "--mesh", "2", "--cluster", "cpu", "--pipeline", "2",
            "--microbatches", "2"]


@pytest.mark.parametrize("argv, says", [
    (["--token-slices", "3", "--run-cpu", "2", "--schedule", "zb"],
     "--schedule zb with --token-slices: token-sliced steps run gpipe or 1f1b"),
])
def test_token_slicing_options_are_checked_before_the_model_loads(tmp_path, capsys, argv, says):
    code, _, err = run_cli(capsys, "compile", "--example", "gpt:tiny", *PIPELINE, *argv,
                           "--out", tmp_path / "out")
    assert code != 0 and says in err, err
    assert "loading the model" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the stage search runs first: about 5 s of CPU
def test_a_model_without_token_ids_is_refused(tmp_path, capsys):
    code, _, err = run_cli(capsys, "compile", "--example", "mlp", *PIPELINE, "--run-cpu", "2",
                           "--token-slices", "2", "--out", tmp_path / "out")
    assert code != 0
    assert "needs a causal language model (attention with causal=True" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gpt_runs_token_sliced_on_two_ranks_equal_to_eager(tmp_path, capsys):
    code, out, err = run_cli(capsys, "compile", "--example", "gpt:tiny", *PIPELINE,
                             "--run-cpu", "2", "--token-slices", "3", "--schedule", "gpipe",
                             "--out", tmp_path / "out")
    assert code == 0, err
    run = json.loads((tmp_path / "out" / "report.json").read_text())["run_cpu_tokens"]
    assert run["token_slices"] == [11, 11, 10] and run["processes"] == 2
    assert run["within_tolerance"] and run["errors"]["loss"]["max_abs_error"] < 1e-5, run["lines"]
    assert run["bytes_sent"] == run["predicted_bytes"] > 0
    assert run["bytes_counted"] >= run["bytes_sent"]  # packed, with alignment padding at most
    assert "run-cpu    token slices [11, 11, 10] (gpipe) on 2 processes, one per stage" in out
    assert "gradients: max abs error" in out
