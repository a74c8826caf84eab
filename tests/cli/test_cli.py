"""The graphpar command: its outputs, and a clear message with no traceback for bad input."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_run import run_cli

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_mlp.py"


def write_model(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text("import torch\nfrom torch import nn\n" + textwrap.dedent(body))
    return path


def test_compile_writes_ir_and_report(tmp_path, capsys):
    code, out, err = run_cli(capsys, "compile", EXAMPLE, "--out", tmp_path / "out",
                             "--dump-after", "all")
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["model"] == "tiny_mlp" and report["mode"] == "infer"
    assert report["ops"] == {"linear": 2, "gelu": 1}
    assert report["parameters"] == 16 * 64 + 64 + 64 * 4 + 4
    # linear + bias, gelu (a transcendental: 10 FLOPs per element), linear + bias
    assert report["flops_estimated"] == (2 * 8 * 16 * 64 + 8 * 64 + 10 * 8 * 64
                                         + 2 * 8 * 64 * 4 + 8 * 4)
    assert [p["name"] for p in report["passes"]] == ["canonicalize", "fold-constants", "cse",
                                                     "dce"]
    text = (tmp_path / "out" / "tiny_mlp.gpir").read_text()
    # each linear carries its module and the source line of the forward that calls it
    forward = next(i for i, line in enumerate(EXAMPLE.read_text().splitlines(), 1)
                   if "self.fc1(x)" in line)
    linears = [line for line in text.splitlines() if " = linear(" in line]
    assert len(linears) == 2
    assert f'{EXAMPLE.name}:{forward}", "fc1")' in linears[0]
    assert f'{EXAMPLE.name}:{forward}", "fc2")' in linears[1]
    assert len(list((tmp_path / "out" / "dumps").iterdir())) == 4
    assert "2 distinct ops" in out and "(estimated)" in out and "(measured)" in out
    code, out, _ = run_cli(capsys, "dump", tmp_path / "out" / "tiny_mlp.gpir")
    assert code == 0 and out.startswith("graph @tiny_mlp(")


def test_compile_training_step(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "compile", EXAMPLE, "--mode", "train", "--optimizer", "sgd",
                           "--out", tmp_path)
    assert code == 0
    text = (tmp_path / "tiny_mlp_train.gpir").read_text()
    assert "%target: f32[8,4] input" in text and "loss" in text
    assert "update(%fc1.weight)" in text


@pytest.mark.parametrize("body, code, says", [
    ("x = 1\n", 2, "no build() function found; a model file defines build()"),
    ("def build():\n    return 3\n", 2, "build() returned int"),
    ("def build(:\n", 2, "model.py:3: importing the model file failed: SyntaxError"),
    ("def build():\n    raise RuntimeError('no weights')\n", 2,
     "model.py:4: build() failed: RuntimeError: no weights"),
    ("""
     class M(nn.Module):
         def forward(self, x):
             if x.sum() > 0:
                 return x * 2
             return x
     def build():
         return M(), (torch.randn(3),)
     """, 1, "cannot capture M.forward"),
    ("""
     class M(nn.Module):
         def forward(self, x):
             return torch.cumprod(x, 0)
     def build():
         return M(), (torch.randn(3),)
     """, 1, "model.py:6: graphpar has no IR op for it"),
])
def test_bad_model_files_give_clear_errors(tmp_path, capsys, body, code, says):
    path = write_model(tmp_path, body)
    out_dir = tmp_path / "out"
    got, out, err = run_cli(capsys, "compile", path, "--out", out_dir)
    assert got == code
    assert says in err
    assert not out_dir.exists(), "a failed compile must leave nothing behind"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".graphpar-")]


def test_untraceable_model_points_at_the_user_line(tmp_path, capsys):
    path = write_model(tmp_path, """
     class M(nn.Module):
         def forward(self, x):
             if x.sum() > 0:
                 return x * 2
             return x
     def build():
         return M(), (torch.randn(3),)
     """)
    _, _, err = run_cli(capsys, "compile", path, "--out", tmp_path / "out")
    assert "model.py:6" in err and "if x.sum() > 0" in err


@pytest.mark.parametrize("argv, code, says", [
    (["compile", "missing.py"], 2, "missing.py: no such file"),
    (["compile", str(EXAMPLE), "--passes", "cse,bogus"], 2, "unknown pass 'bogus'"),
    (["compile", str(EXAMPLE), "--passes", "dce{x=1}"], 2, "pass 'dce' has no option 'x'"),
    (["compile", str(EXAMPLE), "--mode", "fly"], 2, "invalid choice: 'fly'"),
    (["compile", "--example", "nosuchmodel"], 2, "nosuchmodel"),
    (["dump", "missing.gpir"], 1, "missing.gpir: cannot read IR file"),
    (["viz"], 2, "viz needs an IR file"),
])
def test_bad_command_lines(capsys, argv, code, says):
    got, _, err = run_cli(capsys, *argv)
    assert got == code
    assert says in err


def test_corrupt_ir_file_names_line_and_column(tmp_path, capsys):
    path = tmp_path / "bad.gpir"
    path.write_text("graph @g(\n    %x: f32[4] input,\n) {\n  %0 = exp(%y) : f32[4]\n"
                    "  return %0 output\n}\n")
    code, _, err = run_cli(capsys, "dump", path)
    assert code == 1
    assert f"{path}:4:12: %y is used before it is defined" in err


@pytest.mark.parametrize("layout, op_line, says", [
    ("{S(0),R,R}", "", "2:5: graph @g: input %x: layout {S(0),R,R} is not fully replicated "
     "but graph @g is declared on no mesh; declare the mesh it runs on"),
    ("", "  %1 = all_gather(%0) {axes=[7], n=2, dim=0} : f32[8,16]\n",
     "5:3: graph @g, node 1 (all_gather): all_gather runs across the devices of a mesh but "
     "graph @g is declared on no mesh; declare the mesh it runs on"),
])
def test_dump_rejects_sharding_in_a_graph_without_a_mesh(tmp_path, capsys, layout, op_line,
                                                          says):
    path = tmp_path / "nomesh.gpir"
    result = "%1" if op_line else "%0"
    path.write_text(f"graph @g(\n    %x: f32[4,16] {layout} input,\n) {{\n"
                    f"  %0 = relu(%x) : f32[4,16]\n{op_line}  return {result} output\n}}\n")
    code, out, err = run_cli(capsys, "dump", path)
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith(f"graphpar: error: {path}:{says}")
    # one error line; the rest quote the offending source line and point at it
    assert len(lines) == 3 and lines[2].strip() == "^"


def test_console_script_exits_nonzero_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "graphpar.cli", "compile", "missing.py"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "graphpar: error: missing.py: no such file" in result.stderr
    assert "Traceback" not in result.stderr


def test_viz_writes_a_self_contained_page(tmp_path, capsys):
    out = tmp_path / "graph.html"
    code, stdout, _ = run_cli(capsys, "viz", "--example", "mlp:tiny", "-o", out)
    assert code == 0 and "wrote" in stdout
    html = out.read_text()
    assert 'id="graphpar-data"' in html and "linear" in html
    assert "https://" not in html and "http://" not in html


def test_compile_on_a_mesh_runs_the_plan_on_cpu_ranks(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "compile", "--example", "mlp:tiny", "--mode", "train",
                           "--mesh", "2", "--cluster", "cpu", "--run-cpu", "2", "--out", tmp_path)
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["plan"]["mesh"] == "2" and report["plan"]["solver"]["status"] == "OPTIMAL"
    assert report["plan"]["compute_model"] == "roofline, cpu fp32"
    assert "compute as a roofline, cpu fp32" in out
    assert report["run_cpu"]["within_tolerance"] and report["run_cpu"]["checked_steps"] == 3
    assert "verdict    PASS: 3 steps" in out
    assert report["run_cpu"]["bytes_logical"] == pytest.approx(
        report["run_cpu"]["bytes_predicted"])
    # the payloads handed to gloo, beside the plan's definition: the gradients' all-reduce on
    # 2 ranks, an all-gather of (2-1)·B against the plan's 2·(2-1)/2·B
    assert report["run_cpu"]["bytes_counted"] == report["run_cpu"]["bytes_logical"] > 0
    assert "bytes sent per rank: " in out and " counted (gloo payloads), " in out
    assert "{" in (tmp_path / "mlp_tiny_train.gpir").read_text()  # layouts in the IR dump
    assert "run-cpu    2 ranks" in out
    # the measured step time beside the program's estimate (its nodes priced: at most the
    # objective the plan was chosen by), and their ratio
    run = report["run_cpu"]
    assert run["step_seconds_objective"] == report["plan"]["step_seconds_estimated"]
    assert 0 < run["step_seconds_estimated"] <= run["step_seconds_objective"] * (1 + 1e-9)
    assert run["steps"] == 5 and len(run["step_seconds_each"]) == 5
    assert 0 < run["step_seconds_min"] <= run["step_seconds_measured"]
    assert run["step_time_ratio"] == pytest.approx(
        run["step_seconds_measured"] / run["step_seconds_estimated"])
    assert (f"step time  {run['step_seconds_measured'] * 1e3:.3f} ms measured (median of 5, "
            f"min {run['step_seconds_min'] * 1e3:.3f} ms), "
            f"{run['step_seconds_estimated'] * 1e3:.3f} ms estimated, ratio "
            f"{run['step_time_ratio']:.3g}") in out


@pytest.mark.slow
def test_run_cpu_in_train_mode_checks_every_gradient_update_and_state(tmp_path):
    """`--mode train --run-cpu` compares the loss, every gradient, updated parameter and Adam
    state with eager PyTorch + torch.optim, and names the worst tensor of each kind."""
    result = subprocess.run(
        [sys.executable, "-m", "graphpar.cli", "compile", str(EXAMPLE), "--mode", "train",
         "--mesh", "2x2", "--cluster", "cpu", "--run-cpu", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    errors = json.loads((tmp_path / "report.json").read_text())["run_cpu"]["errors"]
    assert list(errors) == ["loss", "gradients", "parameters", "optimizer state"]
    params = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert errors["gradients"]["tensors"] == errors["parameters"]["tensors"] == len(params)
    assert errors["gradients"]["at"] in params and errors["parameters"]["at"] in params
    assert errors["optimizer state"]["tensors"] == 2 * len(params) + 1  # m, v, the step
    for kind, error in errors.items():
        # a tiny MLP's loss, gradients and a first Adam step (each element moves by at most
        # lr = 1e-3, and by exactly lr·sign(g) where |g| is far above its rounding) agree
        # with eager to within float32 rounding: well under 1e-5, and inside the per-element
        # tolerance the check derives from the maths (tolerance_used <= 1)
        assert error["max_abs_error"] < 1e-5, (kind, error)
        assert error["tolerance_used"] <= 1.0, (kind, error)
        line = f"{kind}: max abs error {error['max_abs_error']:.1e}"
        assert line in result.stdout, result.stdout
    assert f"gradients: max abs error {errors['gradients']['max_abs_error']:.1e} at " \
           f"{errors['gradients']['at']}" in result.stdout


@pytest.mark.parametrize("argv, code, says", [
    (["--mesh", "7"], 1, "mesh 7 divides no dimension of graph @mlp_tiny usefully"),
    (["--mesh", "2", "--cluster", "nope"], 2, "unknown cluster preset 'nope'"),
    (["--mesh", "2", "--memory-limit", "1KB"], 1, "no plan fits 1.0 kB per device"),
    (["--mesh", "2x0"], 2, "mesh"),
    (["--mesh", "2", "--run-cpu", "3"], 2, "--run-cpu 3 does not match mesh 2"),
    (["--run-cpu", "2"], 2, "--run-cpu runs a sharded plan: give --mesh too"),
])
def test_bad_meshes_and_limits(tmp_path, capsys, argv, code, says):
    got, _, err = run_cli(capsys, "compile", "--example", "mlp:tiny", "--out", tmp_path / "o",
                          *argv)
    assert got == code
    assert says in err


def test_output_paths_that_cannot_be_written_are_user_errors(tmp_path, capsys):
    """A path under a regular file: the error names it, exit 1, no 'internal error'."""
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc\n")
    cases = [
        ("compile", "--example", "mlp:tiny", "--out", blocker / "out"),
        ("generate", "--example", "gpt:tiny", "--prompts", prompts, "--max-tokens", "1",
         "--quiet", "--out", blocker / "out.jsonl"),
        ("generate", "--example", "gpt:tiny", "--prompts", prompts, "--max-tokens", "1",
         "--quiet", "--dump-programs", blocker / "programs"),
    ]
    for argv in cases:
        code, _, err = run_cli(capsys, *argv)
        assert code == 1, argv
        assert f"graphpar: error: {blocker}" in err and "internal error" not in err, err
