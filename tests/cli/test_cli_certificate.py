"""`graphpar compile --run-cpu` is a certificate: a bug planted in the plan's execution (an
error of 1e-4 of the value in every collective's reduction, or in one compute op of the device
program) makes it exit 1 with a verdict that names the node where the plan first differs; the
same run without the bug exits 0.

The bug is planted in every process of the run (the command and its gloo workers) by a
`sitecustomize` module on PYTHONPATH, as a bug in graphpar's runtime would be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PLANTS = {
    # every reduction of a collective (all_reduce, reduce_scatter) 1e-4 too large
    "collective": """
        import graphpar.runtime.comm as comm, graphpar.runtime.gloo as gloo
        reduce = comm.reduce_tensors
        def planted(tensors, op):
            return reduce(tensors, op) * (1 + 1e-4)
        comm.reduce_tensors = gloo.reduce_tensors = planted
    """,
    # gelu 1e-4 too large where a device program runs it (a rank with a communicator)
    "gelu": """
        from graphpar.backends import interpreter
        function = interpreter.Interpreter._function
        def planted(self, index, node):
            fn, attrs = function(self, index, node)
            if self.comm is None or node.op != "gelu":
                return fn, attrs
            return (lambda *a, **k: fn(*a, **k) * (1 + 1e-4)), attrs
        interpreter.Interpreter._function = planted
    """,
}


def compile_run(tmp_path, plant: str | None, *argv: str) -> tuple[int, str, dict]:
    env = dict(os.environ)
    if plant is not None:
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(textwrap.dedent(PLANTS[plant]))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH")) if p)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "graphpar.cli", "compile", *argv, "--cluster",
                           "cpu", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    report = json.loads((out / "report.json").read_text())
    return done.returncode, done.stdout, report


def verdict(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.strip().startswith("verdict")]
    return line.strip()


@pytest.mark.parametrize("plant", [None, "collective"])
def test_a_planted_collective_bug_fails_the_training_check_and_is_located(tmp_path, plant):
    code, stdout, report = compile_run(tmp_path, plant, "--example", "gpt:tiny", "--mode",
                                       "train", "--mesh", "2x2", "--run-cpu", "4")
    run = report["run_cpu"]
    assert run["bytes_predicted"] > 0  # a plan that communicates
    assert run["checked_steps"] == 3
    if plant is None:
        assert code == 0 and run["within_tolerance"], verdict(stdout)
        assert verdict(stdout).startswith("verdict    PASS: 3 steps")
        assert run["tolerance_used"] <= 1
        return
    assert code == 1
    assert not run["within_tolerance"] and run["tolerance_used"] > 10
    line = verdict(stdout)
    assert line.startswith("verdict    FAIL: 3 steps")
    # the first node that differs is a reshard lowered to a reducing collective
    assert "the plan first differs at %" in line
    assert "= reshard(" in line and ("all_reduce" in line or "reduce_scatter" in line), line
    assert run["first_difference"] in line


def test_a_planted_compute_bug_is_located_at_its_op(tmp_path):
    code, stdout, report = compile_run(tmp_path, "gelu", "--example", "gpt:tiny", "--mesh",
                                       "2x2", "--run-cpu", "4")
    run = report["run_cpu"]
    assert code == 1 and not run["within_tolerance"]
    line = verdict(stdout)
    assert "the plan first differs at %" in line and "= gelu(" in line, line
    assert "mlp" in line  # the module it came from


def test_run_cpu_steps_must_be_positive(capsys):
    sys.path.insert(0, os.path.dirname(__file__))
    from cli_run import run_cli

    for steps in ("0", "-2"):
        code, out, err = run_cli(capsys, "compile", "--example", "mlp:tiny", "--mode", "train",
                                 "--mesh", "2", "--run-cpu", "2", "--run-cpu-steps", steps)
        assert code == 2 and "--run-cpu-steps" in err and len(err.strip().splitlines()) == 1


def test_run_cpu_steps_needs_run_cpu(capsys):
    sys.path.insert(0, os.path.dirname(__file__))
    from cli_run import run_cli

    code, out, err = run_cli(capsys, "compile", "--example", "mlp:tiny", "--mode", "train",
                             "--mesh", "2", "--run-cpu-steps", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--run-cpu-steps 2 sets how many steps --run-cpu compares: give --run-cpu N" in err
