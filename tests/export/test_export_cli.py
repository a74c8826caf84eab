"""`graphpar export`'s bad input: one line naming the option and what to do, exit 2, before
any model is loaded, and nothing written."""

import pytest
from export_testutil import MLP, run_cli


def _export(capsys, out, *extra, to="torch"):
    return run_cli(capsys, "export", MLP, "--mesh", "2x2", "--to", to, "--out", out, *extra)


def test_an_unknown_format_is_named(tmp_path, capsys):
    code, out, err = _export(capsys, tmp_path / "out", to="onnx")
    assert code == 2 and not out
    assert err == ("graphpar: error: --to onnx: unknown format; give one of torch, dtensor, "
                   "mlir\n")
    assert not (tmp_path / "out").exists()


def test_an_output_directory_that_is_not_empty_is_left_alone(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    code, _, err = _export(capsys, out)
    assert code == 2
    assert err == (f"graphpar: error: --out {out} exists and is not empty; give a new or empty "
                   "directory (export never mixes its files with others)\n")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("argv, message", [
    (["--mesh", ""], "export needs --mesh: the device mesh to plan on, e.g. --mesh 2x2"),
    (["--pipeline", "2", "--mode", "train", "--token-slices", "2"],
     "--token-slices: token-sliced pipelines are not exported yet; export the pipeline "
     "without it"),
    (["--pipeline", "2"], "--pipeline slices a training step into stages: add --mode train"),
])
def test_options_that_do_not_go_together_are_named(tmp_path, capsys, argv, message):
    code, _, err = _export(capsys, tmp_path / "out", *argv)
    assert code == 2
    assert err == f"graphpar: error: {message}\n"
