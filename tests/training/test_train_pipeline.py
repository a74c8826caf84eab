"""graphpar train with a pipelined plan, alone (persistent workers of the pipeline and token
pipeline runtimes): losses equal an eager PyTorch loop, checkpoints cross between pipelined,
token-sliced and plain plans, and the final one loads into the plain module equal to
eager's."""

import argparse
from pathlib import Path

import pytest
import torch
from train_testutil import MODEL, checkpoint_model, corpus, eager_gpt_tiny, eager_run, logged_losses

from graphpar.cli.main import main


def train(*args) -> int:
    return main(["train", str(MODEL), "--no-progress", *map(str, args)])


def equals_eager_module(checkpoint, module, tmp_path) -> None:
    """The checkpoint's model, through dcp_to_torch_save, loads into the plain module with
    eager's parameters (SGD: 1e-5)."""
    plain = type(module)(type(module.model)(module.model.config)).eval()
    plain.load_state_dict(checkpoint_model(checkpoint, tmp_path))
    for name, value in module.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=1e-5, atol=1e-6,
                                   msg=name)


def test_pipelined_training_resumes_plain_and_equals_eager(tmp_path, capsys):
    """SGD: 2 steps through 2 stages (one device each, GPipe over 2 microbatches) with a
    checkpoint, then --resume to step 4 on one device without a pipeline. GPT-2's tied
    embedding is updated on one stage and read by both."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    common = ("--optimizer", "sgd", "--lr", "0.5", "--checkpoint-dir", ckpt, "--log", log)
    assert train("--mesh", 2, "--pipeline", 2, "--microbatches", 2, "--schedule", "gpipe",
                 "--steps", 2, *common) == 0
    out = capsys.readouterr().out
    assert "trained tiny_causal_lm on mesh 2: steps 1..2" in out
    assert "pipeline   2 stages on devices [[0], [1]], 2 microbatches, schedule gpipe" in out
    module, losses = eager_run(4, "sgd", 0.5)
    assert set(checkpoint_model(ckpt / "step-2", tmp_path)) == set(module.state_dict())
    assert train("--mesh", 1, "--steps", 4, "--resume", *common) == 0
    assert logged_losses(log) == pytest.approx(losses, rel=1e-4)
    equals_eager_module(ckpt / "step-4", module, tmp_path)


def test_token_sliced_training_equals_eager(tmp_path, capsys):
    """SGD: 2 steps through 2 stages, each sequence cut into 2 token slices (1F1B over the
    (microbatch, slice) items): the token pipeline's persistent workers."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    assert train("--mesh", 2, "--pipeline", 2, "--microbatches", 2, "--token-slices", 2,
                 "--steps", 2, "--optimizer", "sgd", "--lr", "0.5", "--checkpoint-dir", ckpt,
                 "--log", log) == 0
    assert ("pipeline   2 stages on devices [[0], [1]], 2 microbatches, schedule 1f1b, token "
            "slices [4, 4]") in capsys.readouterr().out
    module, losses = eager_run(2, "sgd", 0.5)
    assert logged_losses(log) == pytest.approx(losses, rel=1e-4)
    equals_eager_module(ckpt / "step-2", module, tmp_path)


def test_each_stage_reads_only_what_its_programs_read(tmp_path):
    """gpt:tiny in 3 stages on a mesh of 4, fed from a token file: the first stage reads the
    token ids, the middle stage nothing, the last (on two devices) the targets; each reads
    them as a run reading the whole batch would (counted: tokens taken from the file)."""
    from graphpar.cli.common import load_target, plan_limits
    from graphpar.cost.cluster import mesh_for
    from graphpar.runtime.jobs import JobFolder
    from graphpar.training.data import TokenWindows
    from graphpar.training.loop import TrainOptions, prepare, write_pipeline_job
    from graphpar.training.stage_rank import StageRanks

    mesh = mesh_for("4", "cpu")
    limits = plan_limits(argparse.Namespace(memory_limit=None, time_limit=None,
                                            cluster="cpu"), mesh.cluster)
    data = Path(corpus(tmp_path))
    start = prepare(TrainOptions(spec=load_target(None, "gpt:tiny", "train", batch=4),
                                 mesh=mesh, limits=limits, cluster="cpu", steps=1, data=data,
                                 progress=False, pipeline="3", microbatches=4))
    folder = JobFolder(tmp_path / "job")
    folder.path.mkdir()
    write_pipeline_job(folder, start)
    (ids,), (target,) = TokenWindows(data, 4, 32)(0)
    whole = {"idx": ids, "target": target}
    read = []
    for spec in folder.description["stages"]:
        stage = StageRanks()
        stage.job, stage.folder = folder.description, folder
        # what the worker passes: the names its stage's programs read (StageRunner.needed)
        stage._setup_training({}, {v.name for entry in spec["graphs"].values()
                                   for v in folder.read_graph(entry).inputs})
        micro = stage._batch(0, 4)
        names = [n for k, n in enumerate(stage.names) if k in stage.reads]
        read.append((names, stage.batches.tokens_read))
        for name in names:
            assert torch.equal(torch.cat([m[name] for m in micro]), whole[name])
    assert [spec["device_ids"] for spec in folder.description["stages"]] == [[0], [1], [2, 3]]
    assert read == [(["idx"], 4 * 32), ([], 0), (["target"], 4 * 32)]


def test_pipelined_training_on_a_token_file_equals_eager(tmp_path):
    """--data through 2 stages: the first stage reads the token ids, the second the targets,
    and the losses are eager's."""
    data, log = corpus(tmp_path), tmp_path / "run.jsonl"
    assert main(["train", "--example", "gpt:tiny", "--data", data, "--mesh", "2",
                 "--pipeline", "2", "--microbatches", "2", "--steps", "2", "--optimizer",
                 "sgd", "--lr", "0.1", "--no-progress", "--log", str(log)]) == 0
    assert logged_losses(log) == pytest.approx(eager_gpt_tiny(data, 2, 0.1), rel=1e-4)


@pytest.mark.slow
def test_pipelined_then_token_sliced_then_plain_equal_eager(tmp_path, capsys):
    """SGD, one run of 4 steps in three plans, each resuming the last one's checkpoint: steps
    1-2 through 2 stages (one device each, GPipe over 2 microbatches), step 3 through the same
    stages token slice by token slice (2 slices, 1F1B), step 4 on one device without a
    pipeline. GPT-2's tied embedding is updated on one stage and read by both."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    common = ("--optimizer", "sgd", "--lr", "0.5", "--checkpoint-dir", ckpt, "--log", log)
    assert train("--mesh", 2, "--pipeline", 2, "--microbatches", 2, "--schedule", "gpipe",
                 "--steps", 2, *common) == 0
    assert "trained tiny_causal_lm on mesh 2: steps 1..2" in capsys.readouterr().out
    module, losses = eager_run(4, "sgd", 0.5)
    assert set(checkpoint_model(ckpt / "step-2", tmp_path)) == set(module.state_dict())
    assert train("--mesh", 2, "--pipeline", 2, "--microbatches", 2, "--token-slices", 2,
                 "--steps", 3, "--resume", *common) == 0
    assert train("--mesh", 1, "--steps", 4, "--resume", *common) == 0
    assert logged_losses(log) == pytest.approx(losses, rel=1e-4)
    equals_eager_module(ckpt / "step-4", module, tmp_path)


@pytest.mark.parametrize("args, message", [
    (("--microbatches", 2), "--microbatches cuts the step for pipeline stages: give "
                            "--pipeline"),
    (("--pipeline", 3), "--pipeline 3: more stages than the 2 devices of --mesh 2"),
    (("--pipeline", 2, "--microbatches", 3), "--microbatches 3: the batch of 4 cannot be cut "
                                             "into 3"),
    (("--pipeline", 2, "--token-slices", 2, "--schedule", "zb"),
     "--schedule zb with --token-slices: token-sliced steps run gpipe or 1f1b"),
])
def test_pipeline_usage_errors(args, message, capsys):
    assert train("--mesh", 2, "--steps", 2, *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
