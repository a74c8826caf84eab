"""graphpar train under torchrun as two nodes of two processes on 127.0.0.1 (a 2x2 mesh):
losses equal an eager PyTorch loop with SGD and Adam, a run resumed from step 4 (under
torchrun, on a mesh of 4 and on 1 device) logs the same losses, and the final DCP checkpoint
loads into the plain module equal to eager's; the same with --pipeline 2, and checkpoints
crossing between the pipelined and the plain plan. A rank killed under torchrun stops the
job."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_testutil import MODEL, checkpoint_model, eager_run, logged_losses

from graphpar.cli.main import main
from graphpar.runtime.workers import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def torchrun(cwd: Path, *args, model: Path = MODEL, env: dict | None = None,
             timeout: float = 600, nproc: int = 2) -> list[int]:
    """Two torchrun launches (node ranks 0 and 1, `nproc` processes each) of graphpar train
    on a 2x2 mesh."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
         str(nproc), "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
         str(port), "-m", "graphpar", "train", str(model), "--mesh", "2x2", "--no-progress",
         *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for node in (0, 1)]
    codes = [p.wait(timeout=timeout) for p in procs]
    for p in procs:
        p.output = p.stdout.read()
    if codes != [0, 0]:
        print(procs[0].output[-3000:], procs[1].output[-3000:])
    return codes


def resume_from_step_4(ckpt: Path, to: Path) -> Path:
    (to / "step-4").parent.mkdir(parents=True)
    shutil.copytree(ckpt / "step-4", to / "step-4")
    return to


def train_8_steps_as_eager(tmp_path, module, losses, optimizer, options):
    """8 steps under torchrun with `options`, a checkpoint every 4: the logged losses equal
    eager's, and the final checkpoint loads into the plain module equal to eager's (SGD 1e-5,
    Adam 1e-4). Returns the checkpoint folder."""
    ckpt = tmp_path / "ckpt"
    assert torchrun(tmp_path, "--steps", 8, *options, "--checkpoint-dir", ckpt,
                    "--checkpoint-every", 4, "--log-file", "run.jsonl") == [0, 0]
    assert logged_losses(tmp_path / "run.jsonl") == pytest.approx(losses, rel=1e-4)
    saved = checkpoint_model(ckpt / "step-8", tmp_path)
    plain = type(module)(type(module.model)(module.model.config)).eval()
    plain.load_state_dict(saved)
    tolerance = 1e-5 if optimizer == "sgd" else 1e-4
    for name, value in module.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=tolerance,
                                   atol=tolerance, msg=name)
    return ckpt


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.5), ("adam", 0.01)])
def test_two_nodes_train_resume_and_reshard_equal_eager(tmp_path, optimizer, lr):
    module, losses = eager_run(8, optimizer, lr)
    common = ("--optimizer", optimizer, "--lr", lr)
    ckpt = train_8_steps_as_eager(tmp_path, module, losses, optimizer, common)
    # stopped after 4 and resumed, under torchrun on 2x2, then alone on 4 devices and on 1
    again = resume_from_step_4(ckpt, tmp_path / "again")
    assert torchrun(tmp_path, "--steps", 8, *common, "--checkpoint-dir", again, "--resume",
                    "--log-file", "again.jsonl") == [0, 0]
    assert logged_losses(tmp_path / "again.jsonl") == pytest.approx(losses[4:], rel=1e-4)
    resume_elsewhere(ckpt, tmp_path, common, losses)
    # and under torchrun with a pipelined plan on the same 4 devices
    piped = resume_from_step_4(ckpt, tmp_path / "piped")
    assert torchrun(tmp_path, "--steps", 8, *common, "--pipeline", 2, "--microbatches", 2,
                    "--checkpoint-dir", piped, "--resume", "--log-file", "piped.jsonl") == [0, 0]
    assert logged_losses(tmp_path / "piped.jsonl") == pytest.approx(losses[4:], rel=1e-4)


def resume_elsewhere(ckpt: Path, tmp_path: Path, common: tuple, losses: list[float]) -> None:
    """Checkpoint step-4 of a 2x2 run resumed alone on a mesh of 4 and on 1 device: the same
    losses as the uninterrupted eager loop."""
    for mesh in ("4", "1"):
        moved = resume_from_step_4(ckpt, tmp_path / f"mesh{mesh}")
        assert main(["train", str(MODEL), "--mesh", mesh, "--steps", "8", *map(str, common),
                     "--checkpoint-dir", str(moved), "--resume", "--no-progress",
                     "--log", str(tmp_path / f"mesh{mesh}.jsonl")]) == 0
        assert logged_losses(tmp_path / f"mesh{mesh}.jsonl") == pytest.approx(losses[4:],
                                                                             rel=1e-4)


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.5), ("adam", 0.01)])
def test_two_nodes_train_pipelined_resume_and_reshard_equal_eager(tmp_path, optimizer, lr):
    """The same with --pipeline 2 (two stages on 1x2 sub-meshes, 1F1B over 2 microbatches):
    each stage's ranks write its parameters, and the checkpoint resumes without a pipeline."""
    module, losses = eager_run(8, optimizer, lr)
    common = ("--optimizer", optimizer, "--lr", lr)
    piped = (*common, "--pipeline", 2, "--microbatches", 2)
    ckpt = train_8_steps_as_eager(tmp_path, module, losses, optimizer, piped)
    again = resume_from_step_4(ckpt, tmp_path / "again")
    assert torchrun(tmp_path, "--steps", 8, *piped, "--checkpoint-dir", again, "--resume",
                    "--log-file", "again.jsonl") == [0, 0]
    assert logged_losses(tmp_path / "again.jsonl") == pytest.approx(losses[4:], rel=1e-4)
    resume_elsewhere(ckpt, tmp_path, common, losses)


def test_two_nodes_train_token_sliced_equal_eager(tmp_path):
    """--pipeline 2 --token-slices 2 on the 2x2 mesh: the token pipeline runs one process per
    stage (each stage's 1x2 sub-mesh in lockstep there), so two nodes of one process each;
    SGD losses equal eager's, a resumed run continues them, the checkpoint resumes plain."""
    module, losses = eager_run(8, "sgd", 0.5)
    common = ("--optimizer", "sgd", "--lr", 0.5)
    tokens = (*common, "--pipeline", 2, "--microbatches", 2, "--token-slices", 2)
    ckpt = tmp_path / "ckpt"
    assert torchrun(tmp_path, "--steps", 8, *tokens, "--checkpoint-dir", ckpt,
                    "--checkpoint-every", 4, "--log-file", "run.jsonl", nproc=1) == [0, 0]
    assert logged_losses(tmp_path / "run.jsonl") == pytest.approx(losses, rel=1e-4)
    saved = checkpoint_model(ckpt / "step-8", tmp_path)
    plain = type(module)(type(module.model)(module.model.config)).eval()
    plain.load_state_dict(saved)
    for name, value in module.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=1e-5, atol=1e-5,
                                   msg=name)
    again = resume_from_step_4(ckpt, tmp_path / "again")
    assert torchrun(tmp_path, "--steps", 8, *tokens, "--checkpoint-dir", again, "--resume",
                    "--log-file", "again.jsonl", nproc=1) == [0, 0]
    assert logged_losses(tmp_path / "again.jsonl") == pytest.approx(losses[4:], rel=1e-4)
    moved = resume_from_step_4(ckpt, tmp_path / "mesh1")
    assert main(["train", str(MODEL), "--mesh", "1", "--steps", "8", *map(str, common),
                 "--checkpoint-dir", str(moved), "--resume", "--no-progress",
                 "--log", str(tmp_path / "mesh1.jsonl")]) == 0
    assert logged_losses(tmp_path / "mesh1.jsonl") == pytest.approx(losses[4:], rel=1e-4)


def test_a_rank_killed_under_torchrun_stops_the_job(tmp_path):
    began = time.monotonic()
    codes = torchrun(tmp_path, "--steps", 50, model=MODEL.with_name("dying_lm.py"),
                     env={"DIE_RANK": "3", "DIE_STEP": "2"}, timeout=300)
    assert all(code != 0 for code in codes), codes
    assert time.monotonic() - began < 300
