"""graphpar train alone (its own worker processes): losses equal an eager PyTorch loop, a
resumed run continues them, and the DCP checkpoint loads into the plain module."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from train_testutil import MODEL, checkpoint_model, eager_run, logged_losses

from graphpar.cli.main import main


def train(*args) -> int:
    return main(["train", str(MODEL), "--no-progress", *map(str, args)])


def test_train_checkpoint_resume_and_load_equal_eager(tmp_path, capsys):
    """SGD: 2 steps on two ranks (mesh 2) with a checkpoint, then --resume to step 4 on one
    (DCP reshards the checkpoint to the new plan)."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    common = ("--optimizer", "sgd", "--lr", "0.5", "--checkpoint-dir", ckpt, "--log", log)
    assert train("--mesh", 2, "--steps", 2, *common) == 0
    assert (ckpt / "step-2" / ".metadata").is_file()
    assert train("--mesh", 1, "--steps", 4, "--resume", *common) == 0
    module, losses = eager_run(4, "sgd", 0.5)
    assert logged_losses(log) == pytest.approx(losses, rel=1e-4)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["seconds"] > 0 and r["estimated_seconds"] > 0 for r in records)
    assert (tmp_path / "run.html").read_text().count("<polyline") == 1
    saved = checkpoint_model(ckpt / "step-4", tmp_path)
    plain = type(module)(type(module.model)(module.model.config)).eval()
    plain.load_state_dict(saved)
    for name, value in module.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=1e-5, atol=1e-6,
                                   msg=name)
    out = capsys.readouterr().out
    assert "ms measured" in out and "ms estimated" in out
    if not torch.cuda.is_available():  # --device auto without a GPU: gloo on CPU, as before
        assert "(median, rank 0, cpu, gloo)" in out


def test_device_cpu_trains_as_auto_does_without_a_gpu(tmp_path, capsys):
    """--device cpu: the same losses as eager (and so as the default, auto, on a machine
    without a GPU: the test above)."""
    log = tmp_path / "run.jsonl"
    assert train("--mesh", 2, "--steps", 2, "--optimizer", "sgd", "--lr", "0.5", "--device",
                 "cpu", "--log", log) == 0
    assert logged_losses(log) == pytest.approx(eager_run(2, "sgd", 0.5)[1], rel=1e-4)
    out = capsys.readouterr().out
    assert "(median, rank 0, cpu, gloo)" in out
    # planned for where it runs: the measured CPU cluster, not the GPU presets' numbers; on
    # it this small model is replicated whole (no collective)
    assert "estimated (cost model, cluster cpu-gloo)" in out
    assert ("plan       auto on cpu-gloo: 0 of 16 parameter and buffer tensors split across "
            "devices, 0 collectives a step") in out


def test_a_sharded_checkpoint_resumes_on_another_mesh(tmp_path, capsys):
    """gpt:tiny with Adam planned on the `cpu` preset (whose 20 us collectives make the plan
    shard parameters and optimizer state): the 2x2 run's checkpoint holds DTensor shards;
    resumed on a mesh of 2, another sharded plan, it logs the uninterrupted run's losses."""
    from torch.distributed.checkpoint import FileSystemReader

    data = tmp_path / "text.txt"
    data.write_bytes(Path(json.__file__).read_bytes())  # a real text, as bytes
    common = ["--example", "gpt:tiny", "--data", data, "--optimizer", "adam", "--lr", "0.01",
              "--cluster", "cpu", "--steps", 4]
    first, moved = tmp_path / "ckpt", tmp_path / "moved"
    assert main(["train", *map(str, common), "--mesh", "2x2", "--checkpoint-dir", str(first),
                 "--checkpoint-every", "2", "--log", str(tmp_path / "run.jsonl"),
                 "--no-progress"]) == 0
    said = capsys.readouterr().out.split("plan       auto on cpu: ")[1].split()
    assert int(said[0]) > 0 and said[1:3] == ["of", "29"]  # the plan shards parameters
    metadata = FileSystemReader(str(first / "step-2")).read_metadata().state_dict_metadata
    shards = {key: len(item.chunks) for key, item in metadata.items() if hasattr(item, "chunks")}
    assert any(n > 1 for key, n in shards.items() if key.startswith("model.")), shards
    assert any(n > 1 for key, n in shards.items() if key.startswith("optimizer.")), shards
    shutil.copytree(first / "step-2", moved / "step-2")
    assert main(["train", *map(str, common), "--mesh", "2", "--checkpoint-dir", str(moved),
                 "--resume", "--log", str(tmp_path / "resumed.jsonl"), "--no-progress"]) == 0
    assert logged_losses(tmp_path / "resumed.jsonl") == pytest.approx(
        logged_losses(tmp_path / "run.jsonl")[2:], rel=1e-4)
