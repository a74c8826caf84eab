"""A model file's plain build() planned on the meta device: no weights made when nothing runs,
a memory check before they are made when something does, and a clear error when they do not
fit. The big model here would take 512 GiB of float32 weights."""

import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

from graphpar.cli import main

BIG = """
import torch
from torch import nn

WIDTH = 2**17  # 8 layers of 2**34 weights: 512 GiB in float32

class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

def build():
    model = Big()
    {extra}
    return model, (torch.randn(2, WIDTH, device="cpu"),)
"""

WEIGHT_BYTES = 8 * 2**34 * 4


def write(folder: Path, text: str, name: str = "model.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err


def test_a_plainly_built_model_far_too_big_for_the_machine_plans_in_little_memory(tmp_path):
    model = write(tmp_path, BIG.format(extra=""))
    probe = ("import resource, runpy, sys; sys.argv = sys.argv[1:]; "
             "code = 0\ntry: runpy.run_module('graphpar.cli', run_name='__main__')\n"
             "except SystemExit as e: code = e.code\n"
             "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); "
             "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", probe, "graphpar", "compile", str(model),
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["parameters"] == 8 * 2**34
    peak = int(done.stdout.split("maxrss_kib")[-1]) * 1024
    assert peak < 2**30, f"peak RSS {peak / 2**20:.0f} MiB planning a 512 GiB model"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 8 * 2**30


def test_running_a_model_that_does_not_fit_says_how_many_bytes_before_allocating(tmp_path,
                                                                                 capsys):
    model = write(tmp_path, BIG.format(extra=""))
    code, err = run(capsys, "compile", model, "--mesh", "2", "--cluster", "cpu",
                    "--memory-limit", "none", "--run-cpu", "2", "--out", tmp_path / "out")
    assert code == 1
    assert f"{model}: build() needs 549.8 GB" in err, err
    assert "leave out --run-cpu to plan only" in err
    assert not (tmp_path / "out").exists()


def test_a_build_that_needs_data_falls_back_to_a_real_build_that_fits(tmp_path, capsys):
    model = write(tmp_path, """
        import torch
        from torch import nn

        def build():
            width = int(torch.tensor(8).item())  # a value: cannot be read on meta
            return nn.Linear(width, 4), (torch.randn(2, width),)
        """)
    code, err = run(capsys, "compile", model, "--out", tmp_path / "out")
    assert code == 0, err
    assert "f32[2,8]" in (tmp_path / "out" / "model.gpir").read_text()


def test_a_build_that_needs_data_and_would_not_fit_is_refused_with_its_bytes(tmp_path, capsys):
    model = write(tmp_path, BIG.format(extra="assert model.layers[0].weight[0, 0].item() < 1"))
    code, err = run(capsys, "compile", model, "--out", tmp_path / "out")
    assert code == 1
    assert f"{model}: build() cannot run on the meta device" in err
    assert "(line 19: RuntimeError: Tensor.item() cannot be called on meta tensors)" in err
    assert "needs at least 549.8 GB" in err
    assert "make build() run on the meta device" in err


def test_a_large_tensor_is_checked_again_before_it_is_allocated(tmp_path, capsys, monkeypatch):
    from graphpar.models import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 20 * 2**20)
    model = write(tmp_path, """
        import torch
        from torch import nn

        def build():
            width = int(torch.tensor(4096).item())  # fails on meta before the weights
            return nn.Linear(width, width), (torch.randn(2, width),)
        """)
    code, err = run(capsys, "compile", model, "--out", tmp_path / "out")
    assert code == 1
    assert "(one tensor [4096, 4096] float32, after 8 B made): 67.1 MB needed, 21.0 MB " \
           "available" in err, err
