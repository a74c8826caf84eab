"""Faults while training: a rank that dies stops the job with its name and log tail; SIGTERM
or Ctrl-C stops every rank with exit 143 or 130 and leaves the last complete checkpoint
loadable."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_testutil import MODEL, checkpoint_model

from graphpar.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _graphpar_processes(marker: str) -> list[int]:
    """Processes whose command line names `marker` (this test's folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_text(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("plan", [
    (),
    # a pipelined plan: rank 0 sees its receive from the dead rank break first; the dead rank
    # is still the one named
    pytest.param(("--pipeline", "2", "--microbatches", "2"), marks=pytest.mark.slow),
])
def test_a_dead_rank_stops_the_job_naming_it(tmp_path, monkeypatch, capsys, plan):
    monkeypatch.setenv("DIE_RANK", "1")
    monkeypatch.setenv("DIE_STEP", "2")
    began = time.monotonic()
    code = main(["train", str(MODEL.with_name("dying_lm.py")), "--no-progress", "--mesh", "2",
                 "--steps", "5", *plan])
    assert code == 1 and time.monotonic() - began < 120
    err = capsys.readouterr().err
    assert "training rank 1 exited with code 7" in err
    assert "rank 1 exits at step 2" in err  # its log tail


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, said", [(signal.SIGTERM, 143, "terminated"),
                                                (signal.SIGINT, 130, "interrupted")])
def test_a_signal_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path, signum, code, said):
    """SIGTERM, or Ctrl-C's SIGINT."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    log, ckpt = tmp_path / "run.jsonl", tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphpar", "train", str(MODEL), "--mesh", "2", "--steps",
         "100000", "--optimizer", "sgd", "--checkpoint-dir", str(ckpt), "--checkpoint-every",
         "3", "--log", str(log), "--no-progress"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (log.exists() and
                                                log.read_text().count("\n") >= 8):
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == code
    assert f"graphpar: {said}" in proc.stderr.read()
    assert _graphpar_processes(str(tmp_path)) == []  # no worker left behind
    steps = sorted(int(p.name.removeprefix("step-")) for p in ckpt.glob("step-*"))
    assert steps and steps[-1] >= 6 and steps[-1] % 3 == 0
    assert checkpoint_model(ckpt / f"step-{steps[-1]}", tmp_path)  # complete and loadable
