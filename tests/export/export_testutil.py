"""What the export tests share: the exported program run under torchrun with graphpar blocked,
and eager PyTorch's results to compare with (this folder is on the tests' import path)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from graphpar.cli import main

HERE = Path(__file__).resolve().parent
MLP = HERE / "mlp_model.py"


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr) of `graphpar ARGV`, run in this process; never a
    traceback."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def load_model_file(path: Path):
    spec = importlib.util.spec_from_file_location(f"export_model_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_torchrun(folder: Path, ranks: int, inputs, targets=(), timeout: float = 300) -> dict:
    """Run `folder/program.py` under `torchrun --nproc-per-node ranks` in `folder`, where an
    `import graphpar` fails (a blocker ahead of the installed package on the path): rank 0's
    OUT.pt."""
    torch.save({"inputs": list(inputs), "targets": list(targets)}, folder / "IN.pt")
    blocker = folder.parent / "no-graphpar"
    blocker.mkdir(exist_ok=True)
    (blocker / "graphpar.py").write_text(
        'raise ImportError("the exported program imported graphpar")\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(blocker), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run([str(torchrun), "--nproc-per-node", str(ranks), "program.py",
                           "--inputs", "IN.pt", "--outputs", "OUT.pt"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(folder / "OUT.pt")


def eager_sgd_step(module: torch.nn.Module, inputs, targets, loss_fn, lr: float = 0.01):
    """One eager torch.optim.SGD step: (loss, {fqn: updated parameter}), a tied parameter
    under each of its names (the plan keeps one of them)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    loss = loss_fn(module(*inputs), *targets)
    loss.backward()
    optimizer.step()
    return loss.detach(), {k: p.detach() for k, p in
                           module.named_parameters(remove_duplicate=False)}


def assert_parameters_equal(exported: dict, module: torch.nn.Module, eager: dict) -> None:
    """Every parameter of `module` (once per tied group) is in `exported` and equals eager."""
    assert exported.keys() <= eager.keys(), sorted(exported.keys() - eager.keys())
    assert len(exported) == len(list(module.parameters())), sorted(exported)
    for name, p in exported.items():
        torch.testing.assert_close(p, eager[name], msg=name)
