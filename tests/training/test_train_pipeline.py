"""graphpar train with a pipelined plan, alone (one persistent worker per device, the pipeline
runtime's): losses equal an eager PyTorch loop, the checkpoint it writes resumes on a plain
plan, and the final one loads into the plain module equal to eager's."""

import pytest
import torch
from train_testutil import MODEL, checkpoint_model, eager_run, logged_losses

from graphpar.cli.main import main


def train(*args) -> int:
    return main(["train", str(MODEL), "--no-progress", *map(str, args)])


def test_pipelined_training_resumes_plain_and_equals_eager(tmp_path, capsys):
    """SGD: 2 steps through 2 stages (one device each, GPipe over 2 microbatches) with a
    checkpoint, then --resume to step 4 on one device without a pipeline; the tied embedding
    is updated on one stage and read by both."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    common = ("--optimizer", "sgd", "--lr", "0.5", "--checkpoint-dir", ckpt, "--log", log)
    assert train("--mesh", 2, "--pipeline", 2, "--microbatches", 2, "--schedule", "gpipe",
                 "--steps", 2, *common) == 0
    assert "trained tiny_causal_lm on mesh 2: steps 1..2" in capsys.readouterr().out
    assert train("--mesh", 1, "--steps", 4, "--resume", *common) == 0
    module, losses = eager_run(4, "sgd", 0.5)
    assert logged_losses(log) == pytest.approx(losses, rel=1e-4)
    saved = checkpoint_model(ckpt / "step-2", tmp_path)
    assert set(saved) == set(module.state_dict())
    saved = checkpoint_model(ckpt / "step-4", tmp_path)
    plain = type(module)(type(module.model)(module.model.config)).eval()
    plain.load_state_dict(saved)
    for name, value in module.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=1e-5, atol=1e-6,
                                   msg=name)


@pytest.mark.parametrize("args, message", [
    (("--microbatches", 2), "--microbatches cuts the step for pipeline stages: give "
                            "--pipeline"),
    (("--pipeline", 3), "--pipeline 3: more stages than the 2 devices of --mesh 2"),
    (("--pipeline", 2, "--microbatches", 3), "--microbatches 3: the batch of 4 cannot be cut "
                                             "into 3"),
    (("--pipeline", 2, "--token-slices", 2), "--token-slices: train does not run token-sliced"),
])
def test_pipeline_usage_errors(args, message, capsys):
    assert train("--mesh", 2, "--steps", 2, *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
