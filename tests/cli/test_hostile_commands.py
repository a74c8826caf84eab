"""The commands added after the first hostile-input round, given bad input as a careless or
hostile user gives it, through the real `graphpar` command in subprocesses: `place` SPECs
(numbers, encodings, YAML aliases, --out), the pipeline options, the stage search's messages,
corrupted MPMD programs and CUDA listings, `calibrate --ranks`, and Ctrl-C during `place`.
Each exits 1 or 2 (130 for Ctrl-C) with one line naming the file, field or option and what to
do, no traceback, a few lines at most, and --out left as it was."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_hostile_inputs import ROOT, error_line, graphpar_each, snapshot

SPEC = {"cluster": {"devices": 2, "memory_per_device": "1GB"},
        "models": [{"name": "lm", "example": "gpt:tiny"}],
        "workload": {"arrival": "gamma", "total_rate": 20, "cv": 2, "duration": 30,
                     "warmup": 1},
        "policies": ["alpaserve", "selective-replication"], "plots": {"points": 2}}


def _spec(**workload) -> dict:
    spec = json.loads(json.dumps(SPEC))
    spec["workload"].update(workload)
    return spec


def _yaml_bomb() -> str:
    """A "billion laughs": 9 levels of 9 aliases, 9^9 values once expanded."""
    text = ("cluster: {devices: 2}\nworkload: {total_rate: 5}\nmodels:\n"
            "  - {name: a, example: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]}\n")
    previous = "a"
    for name in "bcdefghi":
        aliases = ", ".join([f"*{previous}"] * 9)
        text += f"  - {{name: {name}, example: &{name} [{aliases}]}}\n"
        previous = name
    return text


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """An --out folder holding an earlier result, which a failed command must leave alone."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "placement.json").write_text('{"earlier": true}\n')
    return folder


def _assert_refused(result, status: int, says: str) -> None:
    line = error_line(result)  # one error line, no traceback, no "internal error"
    assert result.returncode == status, (says, result.stderr)
    assert says in line, (says, line)
    assert len(result.stderr) < 1000 and len(result.stderr.splitlines()) <= 4, result.stderr


def test_place_specs_numbers_encodings_yaml_and_out(tmp_path, out):
    """Classes 1-3: every number checked (finite, bounded, the workload's size estimated
    before it is generated), specs and traces read as UTF-8 with YAML aliases bounded, --out
    checked before any work."""
    files = {
        "inf.yaml": "cluster: {devices: 2}\nmodels: [{name: lm, example: 'gpt:tiny'}]\n"
                    "workload: {total_rate: .inf}\n",
        "nan.json": json.dumps(_spec(cv=float("nan"))),
        "size.json": json.dumps(_spec(total_rate=1e5, duration=1e4)),
        "window.json": json.dumps(_spec(arrival="maf2", window=0.001)),
        "warmup.json": json.dumps(_spec(warmup=100)),
        "bomb.yaml": _yaml_bomb(),
        "int.yaml": "cluster: {devices: 2}\nmodels: [{name: 5, example: 'gpt:tiny'}]\n",
        "bad.yaml": "cluster: {devices: 2\nmodels: [\n",
        "good.json": json.dumps(SPEC),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.yaml").write_bytes("models: [{name: café}]\n".encode("latin-1"))
    (tmp_path / "trace.csv").write_bytes(b"model,arrival_s\nlm,0.5\nl\xffm,1.0\n")
    (tmp_path / "trace.json").write_text(json.dumps({**SPEC, "workload": {"trace":
                                                                          "trace.csv"}}))
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "placement.html").mkdir()
    cases = [
        ("inf.yaml", 2, "inf.yaml: workload.total_rate: expected a positive number, got inf"),
        ("nan.json", 2, "nan.json: workload.cv: expected a positive number, got nan"),
        ("size.json", 2, "size.json: workload: about 2,000,000,000 requests (estimated: "
                         "total_rate x duration, x2 for the plots' rate sweep), more than"),
        ("window.json", 2, "window.json: workload.window: 0.001 s cuts the 30 s into 30,000 "
                           "windows, more than 2,000"),
        ("warmup.json", 2, "warmup.json: workload.warmup: 100 s is not shorter than the "
                           "duration (30 s)"),
        ("bomb.yaml", 2, "bomb.yaml:9: this value expands (YAML aliases included) to over "
                         "100,000 values"),
        ("int.yaml", 2, "int.yaml: models[0].name: expected a name or text on one line, "
                        "got 5"),
        ("bad.yaml", 2, "bad.yaml:2:7: not valid YAML: expected ',' or '}', but got ':'"),
        ("latin1.yaml", 2, "latin1.yaml:1: not a UTF-8 text file (byte 19 is 0xe9)"),
        ("trace.json", 2, "trace.csv:3: not a UTF-8 text file (byte 24 is 0xff)"),
    ]
    before = snapshot(out)
    results = graphpar_each(*[["place", name, "--out", out] for name, _, _ in cases],
                            ["place", "good.json", "--out", ""],
                            ["place", "good.json", "--out", tmp_path / "blocked"], cwd=tmp_path)
    for (_, status, says), result in zip(cases, results):
        _assert_refused(result, status, says)
    _assert_refused(results[-2], 2, "--out: give a directory name")
    _assert_refused(results[-1], 2, f"{tmp_path / 'blocked' / 'placement.html'} exists and "
                                    "is not a file")
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_pipeline_options_stage_search_and_calibrate_ranks(tmp_path):
    """Classes 4, 5 and 7: the pipeline options' form, their output paths and whether they
    act at all are checked before the model loads; a pipeline that fits no memory limit names
    --memory-limit and --microbatches, the options the user typed; calibrate refuses ranks
    the machine cannot hold before starting any."""
    base = ["compile", "--example", "mlp", "--mode", "train", "--mesh", "2", "--cluster", "cpu",
            "--out", tmp_path / "out"]
    cases = [
        (["--pipeline", "9" * 20], "--pipeline 99999999999999999999: more stages than the 2 "
                                   "devices of --mesh 2"),
        (["--pipeline", "2", "--microbatches", "9" * 23], f"--microbatches {'9' * 23}: more "
                                                          "than 65,536"),
        (["--pipeline", "2", "--run-cpu", "2", "--trace", tmp_path],
         f"--trace '{tmp_path}': give a file name, not a directory"),
        (["--microbatches", "2"], "--microbatches cuts the step for pipeline stages: give "
                                  "--pipeline auto|S too"),
        (["--schedule", "zb"], "--schedule orders the pipeline stages' work: give --pipeline"),
    ]
    ranks = (os.cpu_count() or 1) * 4 + 1
    *results, calibrate, memory = graphpar_each(
        *[[*base, *argv] for argv, _ in cases],
        ["calibrate", "--device", "cpu", "--ranks", ranks, "--out", tmp_path / "c.json"],
        [*base, "--pipeline", "2", "--microbatches", "2", "--memory-limit", "1KB"])
    for (_, says), result in zip(cases, results):
        _assert_refused(result, 2, says)
        assert "loading the model" not in result.stderr
    _assert_refused(calibrate, 2, f"--ranks {ranks}: more than 4 CPU ranks per core on this "
                                  f"machine's {os.cpu_count()} cores")
    _assert_refused(memory, 1, "Use more devices, a larger --memory-limit "
                               "(slice-stages{memory_limit=...} when the pass is given in "
                               "--passes), or more, smaller --microbatches.")
    assert list(tmp_path.iterdir()) == []


def test_corrupted_pipeline_programs_and_cuda_listings(tmp_path):
    """Class 6: every reader checks the types of what it reads and names the file's line."""
    (tmp_path / "p_pipeline.gpir").write_text(
        "mesh @mesh = <[1]>\ngraph @stage0_forward(\n    %x: f32[4,16] input,\n"
        ") on @mesh attrs {token_slices=5} {\n  %0 = relu(%x) : f32[4,16]\n"
        "  return %0 output\n}\n")
    (tmp_path / "rank0.calls").write_text(
        "listing @g rank=0 mesh=[1] arena=0 state=256 lower_bound=0\n"
        "  input x state+0 dtype=f32 shape=5 strides=[16,1] role=input\n")
    (tmp_path / "odd.calls").write_text(
        "listing @g rank=0 mesh=[1] arena=0 state=256 lower_bound=0\n"
        "  input x#1 state+0 dtype=f32 shape=[4,16] strides=[16,1] role=input\n")
    dump, viz, listing, odd = graphpar_each(
        ["dump", "p_pipeline.gpir"], ["viz", "p_pipeline.gpir", "-o", "p.html"],
        ["dump", "rank0.calls"], ["dump", "odd.calls"], cwd=tmp_path)
    says = ("p_pipeline.gpir:2: graph @stage0_forward: attribute token_slices=5: expected a "
            "list of token counts >= 1")
    _assert_refused(dump, 1, says)
    _assert_refused(viz, 1, says)
    _assert_refused(listing, 1, "rank0.calls:2: malformed input line: shape=5: expected a "
                                "list of whole numbers")
    _assert_refused(odd, 1, "odd.calls:2: malformed input line: value name 'x#1': expected "
                            "a name with no spaces and no '#'")
    assert not (tmp_path / "p.html").exists()


def test_ctrl_c_during_place_leaves_out_as_it_was(tmp_path, out):
    """Ctrl-C once the placements are printed (the sweeps are running): exit 130 within
    seconds, --out unchanged, no staging folder left, the process gone."""
    (tmp_path / "spec.json").write_text(json.dumps({**SPEC, "plots": {"points": 16}}))
    before = snapshot(out)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GRAPHPAR_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "graphpar.cli", "place", "spec.json",
                             "--out", str(out)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stdout:
            if "per model:" in line:  # the first policy is placed; the rest and the sweeps run
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "graphpar: interrupted"
    assert "Traceback" not in err
    assert snapshot(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".graphpar-")]
