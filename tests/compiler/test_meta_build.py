"""A model file's plain build() planned on the meta device: no weights made when nothing runs,
a memory check before they are made when something does, and a clear error when they do not
fit. The big model here would take 512 GiB of float32 weights."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


# `graphpar ARGV` in a child process that prints its own peak RSS (KiB) last.
PEAK_RSS_PROBE = ("import resource, runpy, sys; sys.argv = sys.argv[1:]; "
                  "code = 0\ntry: runpy.run_module('graphpar.cli', run_name='__main__')\n"
                  "except SystemExit as e: code = e.code\n"
                  "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); "
                  "sys.exit(code)")


def compile_measuring_peak_rss(*argv, env=None) -> int:
    """Peak RSS in bytes of `graphpar compile ARGV` run in a child process, which must
    succeed."""
    done = subprocess.run([sys.executable, "-c", PEAK_RSS_PROBE, "graphpar", "compile",
                           *map(str, argv)], capture_output=True, text=True, timeout=1200,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split("maxrss_kib")[-1]) * 1024


def test_a_plainly_built_model_far_too_big_for_the_machine_plans_in_little_memory(tmp_path):
    model = write(tmp_path, BIG.format(extra=""))
    peak = compile_measuring_peak_rss(model, "--out", tmp_path / "out")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["parameters"] == 8 * 2**34
    # 2 GiB: torch, OR-Tools and a cold numba cache's compiles take ~1.1 GiB in a fresh checkout;
    # the model's real weights would take 512 GiB
    assert peak < 2 * 2**30, f"peak RSS {peak / 2**20:.0f} MiB planning a 512 GiB model"


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("example, parameters", [
    ("hf_llama2_70b.py", 68_976_648_192),  # LLaMA-2-70B
    ("hf_mixtral.py", 46_702_792_704),  # Mixtral-8x7B
])
def test_plainly_built_hugging_face_giants_plan_on_8x8_under_4_gib(tmp_path, example,
                                                                    parameters):
    """The files build with transformers as people write it, no meta device in them."""
    pytest.importorskip("transformers")
    assert "meta" not in (EXAMPLES / example).read_text().split('"""', 2)[2]
    env = {k: v for k, v in os.environ.items()
           if k not in ("GRAPHPAR_HF_LLAMA", "GRAPHPAR_HF_MIXTRAL")}
    peak = compile_measuring_peak_rss(EXAMPLES / example, "--mesh", "8x8",
                                      "--out", tmp_path / "out", env=env)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["parameters"] == parameters
    assert report["plan"]["mesh"] == "8x8"
    assert peak < 4 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"


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


def test_a_meta_build_captures_the_same_ir_as_a_real_one(tmp_path):
    """Parameters, a buffer, a plain tensor attribute (a constant) and an input made
    explicitly on the CPU: on meta all of them, captured to the same IR text."""
    from graphpar.capture import capture_inference
    from graphpar.compiler.model_file import load_model_file
    from graphpar.ir.printer import print_graph

    model = write(tmp_path, """
        import torch
        from torch import nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)
                self.scale = torch.tensor(0.5)
                self.register_buffer("mask", torch.tril(torch.ones(8, 8)))

            def forward(self, x):
                return self.fc(x) * self.scale + x @ self.mask.to(x.device)

        def build():
            return M().cpu(), (torch.randn(4, 8, device="cpu"),)
        """)
    planned = load_model_file(model, weights=False)
    real = load_model_file(model, weights=True)
    assert all(t.is_meta for t in (*planned.module.parameters(), *planned.module.buffers(),
                                   planned.module.scale, *planned.inputs))
    assert not any(t.is_meta for t in (*real.module.parameters(), real.module.scale))
    texts = [print_graph(capture_inference(spec.module, spec.inputs).graph)
             for spec in (planned, real)]
    assert texts[0] == texts[1]
    assert "%scale: f32[] const" in texts[0] and "%mask: f32[8,8]" in texts[0]
