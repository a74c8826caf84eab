"""graphpar train's usage errors and bad checkpoints: one line each, no traceback, no workers
started."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from train_testutil import MODEL

from graphpar.cli.main import main


def train(*args) -> int:
    return main(["train", str(MODEL), "--no-progress", "--mesh", "2", *map(str, args)])


@pytest.mark.parametrize("args, message", [
    (("--steps", 0), "--steps 0"),
    (("--steps", 2, "--resume"), "--resume continues from a checkpoint: give --checkpoint-dir"),
    (("--steps", 2, "--checkpoint-every", 1), "--checkpoint-every writes checkpoints"),
    (("--steps", 2, "--lr", -1), "--lr -1"),
    (("--steps", 2, "--mesh", "2y"), "--mesh 2y"),
])
def test_usage_errors_name_the_option(args, message, capsys):
    assert train(*args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_data_for_a_model_that_is_not_a_causal_lm(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("hello " * 100)
    assert main(["train", "--example", "mlp:tiny", "--mesh", "2", "--steps", "1", "--data",
                 str(text)]) == 2
    assert "--data feeds a causal LM" in capsys.readouterr().err


def test_resume_without_a_checkpoint(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    assert train("--steps", 2, "--resume", "--checkpoint-dir", tmp_path / "ckpt") == 2
    assert "no checkpoint in" in capsys.readouterr().err


def test_resume_a_checkpoint_of_another_model(tmp_path, capsys):
    dcp.save({"model": {"w": torch.zeros(3)}, "step": 1, "data": {"seed": 0, "step": 1}},
             checkpoint_id=str(tmp_path / "ckpt" / "step-1"))
    assert train("--steps", 2, "--resume", "--checkpoint-dir", tmp_path / "ckpt") == 1
    err = capsys.readouterr().err
    assert "step-1: has no 'model.model.transformer" in err and "another model" in err


def test_resume_a_corrupt_checkpoint(tmp_path, capsys):
    broken = tmp_path / "ckpt" / "step-3"
    broken.mkdir(parents=True)
    (broken / ".metadata").write_bytes(b"not a checkpoint")
    assert train("--steps", 4, "--resume", "--checkpoint-dir", tmp_path / "ckpt") == 1
    err = capsys.readouterr().err
    assert "step-3: not a readable checkpoint" in err and "Traceback" not in err


def test_a_batch_of_another_shape_is_named_before_any_rank_starts(tmp_path, capsys):
    model = tmp_path / "bad_batch.py"
    model.write_text(f"import sys\nsys.path.insert(0, {str(MODEL.parent)!r})\n"
                     "import torch\nfrom tiny_causal_lm import build, loss, targets\n\n"
                     "def batch(step):\n"
                     "    ids = torch.zeros(2, 3, dtype=torch.long)\n"
                     "    return (ids,), (ids,)\n")
    assert main(["train", str(model), "--mesh", "2", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "batch(0) inputs are int64[2, 3]; the step was compiled for int64[4, 8]" in err


def test_under_torchrun_the_world_must_be_the_mesh(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert main(["train", str(MODEL), "--mesh", "2x2", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "torchrun started 2 processes (WORLD_SIZE) but --mesh 2x2 has 4 devices" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_device_cuda_without_a_gpu(capsys):
    assert train("--steps", 2, "--device", "cuda") == 2
    err = capsys.readouterr().err
    assert "--device cuda: this torch sees no CUDA GPU" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("requested, facts, chosen", [
    ("auto", dict(cuda=False, gpus=0, ranks=2, pipelined=False), "cpu"),
    ("auto", dict(cuda=True, gpus=1, ranks=2, pipelined=False), "cpu"),  # a GPU per rank
    ("auto", dict(cuda=True, gpus=2, ranks=2, pipelined=True), "cpu"),  # pipelines: CPU
    ("auto", dict(cuda=True, gpus=8, ranks=2, pipelined=False), "cuda"),
    ("cpu", dict(cuda=True, gpus=8, ranks=2, pipelined=False), "cpu"),
    ("cuda", dict(cuda=True, gpus=2, ranks=2, pipelined=False), "cuda"),
])
def test_choose_device(requested, facts, chosen):
    from graphpar.training.loop import choose_device

    assert choose_device(requested, **facts) == chosen


@pytest.mark.parametrize("facts, message", [
    (dict(cuda=False, gpus=0, ranks=2, pipelined=False), "sees no CUDA GPU"),
    (dict(cuda=True, gpus=1, ranks=2, pipelined=False), "2 ranks on this machine but 1 GPUs"),
    (dict(cuda=True, gpus=2, ranks=2, pipelined=True), "pipelined plans train on CPU only"),
])
def test_device_cuda_that_cannot_be_met(facts, message):
    from graphpar.errors import UsageError
    from graphpar.training.loop import choose_device

    with pytest.raises(UsageError, match=message):
        choose_device("cuda", **facts)
