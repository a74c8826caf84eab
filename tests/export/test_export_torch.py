"""`graphpar export --to torch`: the plan as a standalone torch program, run under torchrun
with graphpar not importable, equal to eager PyTorch."""

import torch
from export_testutil import MLP, eager_sgd_step, load_model_file, run_cli, run_torchrun


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
    assert result["parameters"].keys() == params.keys()
    for name, p in params.items():
        torch.testing.assert_close(result["parameters"][name], p, msg=name)
