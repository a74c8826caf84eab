"""The eager PyTorch loop graphpar train is compared with, and checkpoint helpers."""

import importlib.util
from pathlib import Path

import torch

MODEL = Path(__file__).with_name("tiny_causal_lm.py")


def model_file():
    spec = importlib.util.spec_from_file_location("tiny_causal_lm_eager", MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eager_run(steps: int, optimizer: str, lr: float, seed: int = 0):
    """The module and the losses of `steps` torch.optim steps on the file's batch(step),
    built as graphpar train builds it (torch.manual_seed(seed), then build())."""
    m = model_file()
    torch.manual_seed(seed)
    module, _ = m.build()
    if optimizer == "sgd":
        opt = torch.optim.SGD(module.parameters(), lr=lr)
    else:
        opt = torch.optim.Adam(module.parameters(), lr=lr, foreach=False)
    losses = []
    for step in range(steps):
        (ids,), (target,) = m.batch(step)
        loss = m.loss(module(ids), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return module, losses


def corpus(tmp) -> str:
    """A byte corpus: this file's own source."""
    path = tmp / "corpus.txt"
    path.write_bytes(Path(__file__).read_bytes() * 4)
    return str(path)


def eager_gpt_tiny(data: str, steps: int, lr: float) -> list[float]:
    """SGD on gpt:tiny, built as graphpar train builds it (torch.manual_seed(0)), on the
    batches its --data sampler draws (batch 2 x 32 bytes, seed 0)."""
    from graphpar.models import get_model
    from graphpar.training.data import TokenWindows

    torch.manual_seed(0)
    example = get_model("gpt", "tiny", train=True)
    module = example.module
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    windows, losses = TokenWindows(data, 2, 32, seed=0), []
    for step in range(steps):
        (ids,), (target,) = windows(step)
        loss = example.loss_fn(module(ids), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def logged_losses(path: Path) -> list[float]:
    import json

    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def checkpoint_model(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The ["model"] of a DCP checkpoint, through torch's own dcp_to_torch_save."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(out))
    return torch.load(out, weights_only=False)["model"]
