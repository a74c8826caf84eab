"""Model files behave like scripts: they import the modules next to them."""

import json
import sys
import textwrap
from pathlib import Path

from graphpar.cli import main

LAYERS = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x)) + x
"""

MODEL = """
import torch
from torch import nn
from my_layers import Block

def build():
    return nn.Sequential(Block(8), Block(8)), (torch.randn(2, 8),)
"""


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def compile_file(capsys, *argv) -> tuple[int, str]:
    code = main(["compile", *map(str, argv)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err


def test_a_model_file_imports_its_neighbour_and_leaves_sys_path_as_it_was(tmp_path, capsys):
    write(tmp_path, "my_layers.py", LAYERS)
    model = write(tmp_path, "model.py", MODEL)
    path_before = list(sys.path)
    code, err = compile_file(capsys, model, "--out", tmp_path / "out")
    assert code == 0, err
    assert sys.path == path_before
    assert "my_layers" not in sys.modules
    text = (tmp_path / "out" / "model.gpir").read_text()
    assert text.count(" = linear(") == 2


def test_two_model_files_with_same_named_neighbours_get_their_own(tmp_path, capsys):
    for folder, width in (("a", 8), ("b", 4)):
        write(tmp_path / folder, "my_layers.py", LAYERS)
        write(tmp_path / folder, "model.py", MODEL.replace("8", str(width)))
    for folder, width in (("a", 8), ("b", 4)):
        code, err = compile_file(capsys, tmp_path / folder / "model.py", "--out",
                                 tmp_path / folder / "out")
        assert code == 0, err
        text = (tmp_path / folder / "out" / "model.gpir").read_text()
        assert f"f32[2,{width}]" in text


def test_a_missing_neighbour_names_the_import_and_the_file(tmp_path, capsys):
    model = write(tmp_path, "model.py", MODEL)
    code, err = compile_file(capsys, model, "--out", tmp_path / "out")
    assert code == 2
    assert "ModuleNotFoundError: No module named 'my_layers'" in err
    assert f"the import of 'my_layers' at {model}:4 found no module" in err
    assert not (tmp_path / "out").exists()


def test_a_neighbour_missing_its_own_import_names_the_neighbour(tmp_path, capsys):
    layers = write(tmp_path, "my_layers.py", "import my_helpers\n" + LAYERS)
    model = write(tmp_path, "model.py", MODEL)
    code, err = compile_file(capsys, model, "--out", tmp_path / "out")
    assert code == 2
    assert f"the import of 'my_helpers' at {layers}:1 found no module" in err
    assert sys.path.count(str(tmp_path)) == 0


def test_an_import_inside_build_finds_the_neighbour_too(tmp_path, capsys):
    write(tmp_path, "my_layers.py", LAYERS)
    model = write(tmp_path, "model.py", """
        import torch
        from torch import nn

        def build():
            from my_layers import Block
            return Block(8), (torch.randn(2, 8),)
        """)
    code, err = compile_file(capsys, model, "--out", tmp_path / "out")
    assert code == 0, err


def test_compiling_makes_no_weights_and_running_says_when_they_do_not_fit(
        tmp_path, capsys, monkeypatch):
    from graphpar.models import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    # the tiny preset's 540 kB of weights do not fit the 1 kB: compiling must make none
    code, err = compile_file(capsys, "--example", "gpt:tiny", "--mode", "train",
                             "--out", tmp_path / "plan")
    assert code == 0, err
    code, err = compile_file(capsys, "--example", "gpt:tiny", "--mesh", "2", "--run-cpu", "2",
                             "--out", tmp_path / "out")
    assert code == 1
    assert "the weights of gpt_tiny: 539.6 kB needed, 1.0 kB available" in err
    assert "--run-cpu" in err and "--memory-limit" in err and "graphpar bug" not in err
    assert not (tmp_path / "out").exists()


def test_running_a_build_that_cannot_fit_is_the_users_error(tmp_path, capsys):
    model = write(tmp_path, "model.py", """
        import torch

        def build():
            return torch.nn.Linear(2**30, 2**30), (torch.randn(2, 2**30),)
        """)
    code, err = compile_file(capsys, model, "--mesh", "2", "--run-cpu", "2",
                             "--out", tmp_path / "out")
    assert code == 1
    assert f"{model}: build() needs 4611.7 PB (" in err and "graphpar bug" not in err
    assert "leave out --run-cpu to plan only" in err


def test_a_model_file_that_builds_on_meta_compiles_and_runs_with_its_own_init(tmp_path, capsys):
    write(tmp_path, "my_layers.py", LAYERS)
    model = write(tmp_path, "model.py", """
        import torch
        from torch import nn
        from my_layers import Block

        def build():
            with torch.device("meta"):
                module = nn.Sequential(Block(8), Block(8))
            return module, (torch.randn(2, 8),)
        """)
    code, err = compile_file(capsys, model, "--mesh", "2", "--run-cpu", "2",
                             "--out", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["parameters"] == 2 * (8 * 8 + 8)
    assert report["run_cpu"]["max_abs_error"] < 1e-5
