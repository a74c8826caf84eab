"""graphpar train on GPUs: gpt:tiny on two GPUs with NCCL logs the losses of the same run on
CPU ranks over gloo, alone and under torchrun, and a checkpoint written from the GPUs resumes
on CPU ranks. Skipped without two CUDA GPUs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_testutil import logged_losses

from graphpar.cli.main import main
from graphpar.runtime.workers import free_port

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def corpus(tmp: Path) -> Path:
    """A small byte corpus: this repository's training loop, as text."""
    path = tmp / "corpus.txt"
    path.write_bytes((ROOT / "graphpar" / "training" / "loop.py").read_bytes())
    return path


def train(tmp: Path, log: str, *args) -> int:
    return main(["train", "--example", "gpt:tiny", "--data", str(corpus(tmp)), "--mesh", "2",
                 "--optimizer", "sgd", "--lr", "0.1", "--no-progress", "--log",
                 str(tmp / log), *map(str, args)])


def test_two_gpus_over_nccl_equal_cpu_ranks_and_resume_on_cpu(tmp_path, capsys):
    assert train(tmp_path, "cpu.jsonl", "--steps", 4, "--device", "cpu") == 0
    cpu = logged_losses(tmp_path / "cpu.jsonl")
    ckpt = tmp_path / "ckpt"
    assert train(tmp_path, "gpu.jsonl", "--steps", 4, "--device", "cuda", "--checkpoint-dir",
                 ckpt, "--checkpoint-every", 2) == 0
    assert "cuda, NCCL" in capsys.readouterr().out
    assert logged_losses(tmp_path / "gpu.jsonl") == pytest.approx(cpu, rel=1e-4)
    # the GPUs' checkpoint of step 2, loaded by CPU ranks: steps 3 and 4 as the CPU run's
    (ckpt / "step-4").rename(tmp_path / "gpu-step-4")
    assert train(tmp_path, "resumed.jsonl", "--steps", 4, "--device", "cpu", "--resume",
                 "--checkpoint-dir", ckpt) == 0
    assert logged_losses(tmp_path / "resumed.jsonl") == pytest.approx(cpu[2:], rel=1e-4)


def test_torchrun_on_two_gpus_equals_cpu_ranks(tmp_path):
    assert train(tmp_path, "cpu.jsonl", "--steps", 4, "--device", "cpu") == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "graphpar",
         "train", "--example", "gpt:tiny", "--data", str(corpus(tmp_path)), "--mesh", "2",
         "--optimizer", "sgd", "--lr", "0.1", "--no-progress", "--steps", "4", "--device",
         "cuda", "--log-file", str(tmp_path / "gpu.jsonl")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert logged_losses(tmp_path / "gpu.jsonl") == pytest.approx(
        logged_losses(tmp_path / "cpu.jsonl"), rel=1e-4)
