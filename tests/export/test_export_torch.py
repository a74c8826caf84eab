"""`graphpar export --to torch`: the plan as a standalone torch program, run under torchrun
with graphpar not importable, equal to eager PyTorch."""

import sys

import pytest
import torch
from export_testutil import (
    MLP,
    assert_parameters_equal,
    eager_sgd_step,
    load_model_file,
    run_cli,
    run_torchrun,
)


def test_a_sharded_training_step_runs_under_torchrun_and_equals_eager(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "export", MLP, "--mode", "train", "--optimizer", "sgd",
                              "--mesh", "2x2", "--cluster", "cpu", "--to", "torch",
                              "--out", out)
    assert code == 0
    assert "torchrun --nproc-per-node 4 program.py" in stdout
    program = (out / "program.py").read_text()
    assert "graphpar" not in program.split('"""', 2)[2]  # no import, no call
    assert "reduce_scatter(" in program and "all_gather(" in program  # the plan is sharded
    model = load_model_file(MLP)
    module, (x,) = model.build()
    (target,) = model.targets()
    result = run_torchrun(out, 4, [x], [target])
    loss, params = eager_sgd_step(module, (x,), (target,), model.loss)
    torch.testing.assert_close(result["loss"], loss)
    assert_parameters_equal(result["parameters"], module, params)


HF_GPT2 = MLP.parents[2] / "examples" / "hf_gpt2.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_a_hugging_face_causal_lm_on_2x2_equals_eager(tmp_path, capsys, mode):
    """The issue's acceptance: a tiny Hugging Face GPT-2's 2x2 plan (sharded on the cpu
    cluster) under torchrun on 4 gloo ranks, torch alone: inference outputs, and one SGD
    step's loss and every updated parameter, equal eager PyTorch."""
    out = tmp_path / "out"
    code, _, _ = run_cli(capsys, "export", HF_GPT2, "--mode", mode, "--optimizer", "sgd",
                         "--mesh", "2x2", "--cluster", "cpu", "--to", "torch", "--out", out)
    assert code == 0
    assert "all_gather(" in (out / "program.py").read_text()
    model = _load(HF_GPT2)
    module, (ids,) = model.build()
    if mode == "infer":
        result = run_torchrun(out, 4, [ids])
        with torch.no_grad():
            torch.testing.assert_close(result["outputs"][0], module(ids))
        return
    (target,) = model.targets()
    result = run_torchrun(out, 4, [ids], [target])
    loss, params = eager_sgd_step(module, (ids,), (target,), model.loss)
    torch.testing.assert_close(result["loss"], loss)
    assert_parameters_equal(result["parameters"], module, params)


@pytest.mark.slow
@pytest.mark.parametrize("model_file", [MLP, HF_GPT2], ids=["mlp", "hf_gpt2"])
def test_a_two_stage_pipeline_on_4_ranks_equals_eager(tmp_path, capsys, model_file):
    """Two stages, each sharded on a sub-mesh of 2 ranks, 1F1B over 4 microbatches: one SGD
    step under torchrun, torch alone, equal to eager."""
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "export", model_file, "--mode", "train", "--optimizer",
                              "sgd", "--mesh", "2x2", "--cluster", "cpu", "--pipeline", "2",
                              "--to", "torch", "--out", out)
    assert code == 0
    assert "stages     2 (1f1b, 4 microbatches), ranks [[0, 1], [2, 3]]" in stdout
    program = (out / "program.py").read_text()
    assert "def stage1_backward(inputs):" in program and "graphpar" not in program.split(
        '"""', 2)[2]
    model = _load(model_file)
    module, (x,) = model.build()
    (target,) = model.targets()
    result = run_torchrun(out, 4, [x], [target])
    loss, params = eager_sgd_step(module, (x,), (target,), model.loss)
    torch.testing.assert_close(result["loss"], loss)
    assert_parameters_equal(result["parameters"], module, params)


def _load(model_file):
    sys.path.insert(0, str(model_file.parent))  # hf_gpt2 imports its sibling hf_opt
    try:
        return load_model_file(model_file)
    finally:
        sys.path.remove(str(model_file.parent))
