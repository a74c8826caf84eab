"""`graphpar compile --pipeline S --token-slices auto|N`: the slicing recorded in every stage
graph and the report, and clear errors for requests that cannot be met."""

import json

import pytest
import torch
from cli_run import run_cli

import graphpar
from graphpar.errors import UsageError
from graphpar.ir.parser import parse_program


@pytest.mark.slow
def test_gpt_pipeline_with_token_slices_records_them_and_reports_both_estimates(tmp_path,
                                                                                 capsys):
    code, out, err = run_cli(capsys, "compile", "--example", "gpt", "--mode", "train",
                             "--mesh", "2", "--cluster", "cpu", "--pipeline", "2",
                             "--microbatches", "2", "--token-slices", "auto",
                             "--out", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    tokens = report["pipeline"]["token_slicing"]
    assert sum(tokens["token_slices"]) == 32  # the tiny GPT's sequence
    assert tokens["batch_slices"] == [1, 1]  # 2 microbatches of the example's 2 sequences
    assert tokens["step_seconds_estimated"] <= tokens["step_seconds_unsliced_estimated"]
    ir_file = next(f for f in report["files"] if f.endswith(".gpir"))
    for graph in parse_program((tmp_path / "out" / ir_file).read_text()):
        assert list(graph.attrs["token_slices"]) == tokens["token_slices"]
        assert list(graph.attrs["batch_slices"]) == [1, 1]
    assert 0 < tokens["schedule_step_seconds_estimated"]
    trace = json.loads((tmp_path / "out" / tokens["trace"]).read_text())["traceEvents"]
    units = {(e["args"]["microbatch"], e["args"]["slice"]) for e in trace
             if e.get("cat") == "compute"}
    assert units == {(m, j) for m in range(2) for j in range(len(tokens["token_slices"]))}
    assert "without token slicing (estimated)" in out


@pytest.mark.parametrize("argv, says", [
    (["--mode", "train", "--mesh", "2", "--token-slices", "auto"],
     "--token-slices sends token slices through pipeline stages: give --pipeline"),
    (["--mode", "train", "--mesh", "2", "--pipeline", "2", "--token-slices", "0"],
     "--token-slices 0: give 'auto' or a number of slices"),
    (["--mode", "train", "--mesh", "2", "--pipeline", "2", "--token-slices", "many"],
     "--token-slices many: give 'auto' or a number of slices"),
])
def test_token_slice_options_are_checked_before_the_model_loads(tmp_path, capsys, argv, says):
    code, out, err = run_cli(capsys, "compile", "--example", "gpt", *argv,
                             "--out", tmp_path / "out")
    assert code != 0 and says in err
    assert not (tmp_path / "out").exists()


def test_api_token_slices_need_a_pipeline():
    with pytest.raises(UsageError, match="token_slices= sends token slices through pipeline "
                                         "stages: pass pipeline= too"):
        graphpar.compile(torch.nn.Linear(2, 2), [torch.ones(1, 2)], mode="train",
                         token_slices="auto")


@pytest.mark.slow  # about a minute of CPU each: the ILP's stage search, 3 slice captures, gloo
@pytest.mark.parametrize("example", ["hf_qwen2", "hf_mistral", "hf_bloom"])
def test_hf_causal_lm_model_files_train_token_pipelined_equal_to_eager(tmp_path, capsys,
                                                                     example):
    """Hugging Face builds its causal masks as tensors (Mistral's with a sliding window of 6
    of its 16 tokens; BLOOM's added to scores its attention writes out as ops, with ALiBi):
    slice-tokens reads causality off them, and the step run slice by slice on 2 ranks equals
    eager."""
    from pathlib import Path

    model_file = Path(__file__).resolve().parents[2] / "examples" / f"{example}.py"
    code, out, err = run_cli(capsys, "compile", model_file, "--mode", "train", "--mesh", "2",
                             "--cluster", "cpu", "--pipeline", "2", "--token-slices", "3",
                             "--run-cpu", "2", "--out", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["pipeline"]["token_slicing"]["token_slices"] == [6, 5, 5]
    assert "token slices [6, 5, 5] (1f1b) on 2 processes" in out
    assert "verdict    PASS" in out
