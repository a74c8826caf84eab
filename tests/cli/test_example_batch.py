"""--batch and --seq-len: the global batch of a bundled example, from the command line."""

import json

import pytest
from cli_run import run_cli


def test_batch_and_seq_len_size_the_examples_inputs(tmp_path, capsys):
    code, out, err = run_cli(capsys, "compile", "--example", "gpt:tiny", "--batch", "8",
                             "--seq-len", "16", "--out", tmp_path / "out")
    assert code == 0, err
    text = (tmp_path / "out" / "gpt_tiny.gpir").read_text()
    assert "%idx: i64[8,16] input" in text
    # --seq-len is the model's context too: 16 learned positions, not the preset's 32
    assert "%pos_emb.weight: f32[16,64]" in text


def test_a_global_batch_of_8_pipelines_as_4_microbatches_of_2(tmp_path, capsys):
    code, out, err = run_cli(capsys, "compile", "--example", "mlp", "--mode", "train",
                             "--mesh", "2", "--cluster", "cpu", "--pipeline", "2",
                             "--batch", "8", "--microbatches", "4", "--schedule", "gpipe",
                             "--out", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["pipeline"]["microbatches"] == 4
    assert "f32[2,32]" in (tmp_path / "out" / "mlp_tiny_train_pipeline.gpir").read_text()


def test_viz_takes_the_batch_too(tmp_path, capsys):
    code, out, err = run_cli(capsys, "viz", "--example", "mlp", "--batch", "6",
                             "-o", tmp_path / "g.html")
    assert code == 0, err
    assert "f32[6,32]" in (tmp_path / "g.html").read_text()


MODEL = """
import torch

def build():
    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)
"""


@pytest.mark.parametrize("command, argv, says", [
    ("compile", ["MODEL", "--batch", "8"],
     "--batch 8: only for a bundled --example; {model} decides its own example inputs"),
    ("explain", ["MODEL", "--mesh", "2", "--seq-len", "8"],
     "--seq-len 8: only for a bundled --example"),
    ("viz", ["MODEL", "--batch", "8"], "--batch 8: only for a bundled --example"),
    ("compile", ["--example", "mlp", "--seq-len", "8"],
     "--seq-len 8: mlp is not a token model (its inputs have no sequence); give --batch alone"),
    ("compile", ["--example", "gpt:tiny", "--batch", "0"], "--batch 0: give at least 1"),
])
def test_batch_options_a_model_file_or_a_model_cannot_take_are_usage_errors(
        tmp_path, capsys, command, argv, says):
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    argv = [str(model) if a == "MODEL" else a for a in argv]
    out_option = {"viz": ["-o", tmp_path / "g.html"], "compile": ["--out", tmp_path / "o"],
                  "explain": []}[command]
    code, out, err = run_cli(capsys, command, *argv, *out_option)
    assert code == 2
    assert says.format(model=model) in err, err


def test_power_of_two_hosts_leaves_out_a_stage_on_3_hosts(tmp_path, capsys):
    code, _, err = run_cli(capsys, "compile", "--example", "mlp", "--mode", "train",
                           "--mesh", "3x1", "--cluster", "cpu", "--pipeline", "1",
                           "--microbatches", "2", "--power-of-two-hosts",
                           "--out", tmp_path / "out")
    assert code == 1  # without the flag the one stage may span the 3 hosts
    assert "no pipeline of 1 stages covers exactly 3 devices with the allowed sub-meshes" in err
