"""Bad input, as a hostile user gives it, through the real `graphpar` command in a subprocess:
exit 1 or 2 (130/143 for signals), one line naming what and where, no traceback, and `--out`
left as it was."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphpar.cli import main

ROOT = Path(__file__).parents[2]
MODEL = ROOT / "examples" / "tiny_mlp.py"

GOOD_GRAPH = """\
graph @g(
    %x: f32[4,16] {S(0),R} input,
) on @mesh {
  %0 = relu(%x) : f32[4,16] {S(0),R}
  %1 = all_gather(%0) {axes=[0], n=2, dim=0} : f32[8,16] {R,R}
  return %1 output
}
"""
GOOD_IR = "mesh @mesh = <[2, 2]>\n" + GOOD_GRAPH


def graphpar(*argv, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GRAPHPAR_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "graphpar.cli", *map(str, argv)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


_BATCH = """
import contextlib, io, json, sys
from graphpar.cli import main
results = []
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def graphpar_each(*command_lines, cwd: Path | None = None) -> list[subprocess.CompletedProcess]:
    """Several command lines through the CLI's entry point, one after the other in one
    subprocess: one torch import for a table of cheap cases."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GRAPHPAR_DEBUG", None)
    batch = subprocess.run([sys.executable, "-c", _BATCH], cwd=cwd, env=env, text=True,
                           input=json.dumps([[str(a) for a in argv] for argv in command_lines]),
                           capture_output=True, timeout=300)
    assert batch.returncode == 0 and "Traceback" not in batch.stderr, batch.stderr
    return [subprocess.CompletedProcess(argv, code, "", err)
            for argv, (code, err) in zip(command_lines, json.loads(batch.stdout))]


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one error line; progress lines ("graphpar: ... ...") may come before it."""
    err = result.stderr
    assert "Traceback" not in err and "internal error" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("graphpar: error: ")]
    assert len(errors) == 1, err
    return errors[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """An --out folder holding an earlier result, which a failed command must leave alone."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "report.json").write_text('{"earlier": true}\n')
    return folder


# --- 1. reading files ---------------------------------------------------------------------------

def test_binary_and_directory_inputs(tmp_path):
    garbage = tmp_path / "garbage.gpir"
    garbage.write_bytes(bytes(range(256)) * 8)
    dump, directory, prompts = graphpar_each(
        ["dump", garbage], ["dump", tmp_path],
        ["generate", "--example", "gpt:tiny", "--prompts", garbage])
    assert dump.returncode == 1
    assert f"{garbage}: not a UTF-8 text file" in error_line(dump)
    assert directory.returncode == 1
    assert f"{tmp_path}: is a directory, not an IR file" in error_line(directory)
    assert prompts.returncode == 2
    assert f"--prompts {garbage}: not a UTF-8 text file" in error_line(prompts)


# --- 2. the IR parser lets no exception escape ---------------------------------------------------

MALFORMED = [
    ("dim=0}", 'dim=0, note="bad\\q"}', "g.gpir:6:51: bad string literal"),
    ("dim=0}", "dim=0, deep=" + "[" * 100_000 + "}", "g.gpir:6:83: lists nested deeper"),
    ("f32[4,16] {S(0),R} input", "f32[-2,16] input", "g.gpir:3:13: dimension size -2"),
    ("f32[4,16] {S(0),R} input", "f32[" + "9" * 23 + ",16] input", "g.gpir:3:13: dimension"),
    ("f32[4,16] {S(0),R} input", "f32[1e23,16] input", "g.gpir:3:13: expected a dimension"),
]


def test_malformed_ir_is_a_parse_error_with_line_and_column(tmp_path):
    for i, (old, new, _) in enumerate(MALFORMED):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "g.gpir").write_text(GOOD_IR.replace(old, new, 1))
    results = graphpar_each(*[["dump", f"{i}/g.gpir"] for i in range(len(MALFORMED))],
                            cwd=tmp_path)
    for i, ((_, _, says), result) in enumerate(zip(MALFORMED, results)):
        assert result.returncode == 1, says
        assert f"{i}/" + says in error_line(result)


# --- 3. invalid IR is rejected, by dump and by viz ------------------------------------------------

INVALID = [
    ("{S(0),R} input", "{S(5),R} input", "g.gpir:3:5: graph @g: input %x: layout {S(5),R} "
                                         "shards dim 5"),
    ("{S(0),R} input", "{S(0),R,R} input", "g.gpir:3:5: graph @g: input %x: "
                                           "layout {S(0),R,R} has 3 placement(s)"),
    ("axes=[0]", "axes=[7]", "g.gpir:6:3: graph @g, node 1 (all_gather): mesh axis 7 does not "
                             "exist"),
    ("<[2, 2]>", "<[2, q]>", "g.gpir:1:19: expected an axis size, found 'q'"),
    ("output\n}\n", "output\n}\n" + GOOD_GRAPH,
     "g.gpir:9:7: graph @g is defined twice (first on line 2)"),
    (": f32[4,16] {S(0),R}\n", ": f32[4,17] {S(0),R}\n", "g.gpir:5: graph @g, node 0 (relu): "
                                                       "result types f32[4,17]"),
]


def test_invalid_ir_is_rejected_by_dump_and_viz(tmp_path):
    runs = []
    for i, (old, new, _) in enumerate(INVALID):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "g.gpir").write_text(GOOD_IR.replace(old, new, 1))
        runs += [["dump", f"{i}/g.gpir"], ["viz", f"{i}/g.gpir", "-o", f"{i}/g.html"]]
    (tmp_path / "good.gpir").write_text(GOOD_IR)
    *results, good = graphpar_each(*runs, ["dump", "good.gpir"], cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    for i, (_, _, says) in enumerate(INVALID):
        for result in results[2 * i:2 * i + 2]:
            assert result.returncode == 1, says
            assert f"{i}/" + says in error_line(result)
        assert [p.name for p in (tmp_path / str(i)).iterdir()] == ["g.gpir"], \
            "viz must write nothing for invalid IR"


# --- 4. the model-file contract ------------------------------------------------------------------

BROKEN_CONTRACTS = [
    ("def build():\n    return M(), 3\n", "infer",
     "model.py: build()'s example inputs must be a tuple of tensors, got int"),
    ("def build():\n    return M(), (torch.randn(3),)\ndef targets():\n    raise KeyError('y')\n"
     "def loss(out, y):\n    return out.sum()\n", "train", "model.py:10: targets() failed: "
                                                        "KeyError"),
    ("def build():\n    return M(), (torch.randn(3),)\ndef targets():\n    return 5\n"
     "def loss(out, y):\n    return out.sum()\n", "train", "model.py: targets() must be a "
                                                        "tuple of tensors, got int"),
]
MODULE = ("import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
          "        return x * 2\n\n")


def test_model_files_that_break_the_contract(tmp_path, out):
    runs = []
    for i, (body, mode, _) in enumerate(BROKEN_CONTRACTS):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "model.py").write_text(MODULE + body)
        runs.append(["compile", f"{i}/model.py", "--mode", mode, "--out", out])
    before = snapshot(out)
    for i, ((_, _, says), result) in enumerate(zip(BROKEN_CONTRACTS,
                                                   graphpar_each(*runs, cwd=tmp_path))):
        assert result.returncode == 2, says
        assert f"{i}/" + says in error_line(result)
    assert snapshot(out) == before


def test_ctrl_c_while_importing_a_model_is_an_interrupt(tmp_path, out):
    model = tmp_path / "model.py"
    model.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n")
    before = snapshot(out)
    result = graphpar("compile", model, "--out", out)
    assert result.returncode == 130
    assert result.stderr.strip().splitlines()[-1] == "graphpar: interrupted"
    assert snapshot(out) == before


def test_a_forward_returning_none_is_refused_at_compile(tmp_path, out):
    model = tmp_path / "model.py"
    model.write_text("import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
                     "        x * 2\n\ndef build():\n    return M(), (torch.randn(3),)\n")
    result = graphpar("compile", model, "--out", out)
    assert result.returncode == 1
    assert "returns nothing; a model's forward must return a tensor" in error_line(result)


# --- 5. options are checked before the model is loaded ------------------------------------------

BAD_OPTIONS = [
    (["--mesh", "2", "--memory-limit", "abc"], "--memory-limit abc: expected a size"),
    (["--mesh", "2", "--time-limit", "nan"], "--time-limit nan: give a positive number"),
    (["--mesh", "2", "--time-limit", "-1"], "--time-limit -1.0: give a positive number"),
    (["--passes", "auto-shard{mesh=}"], "pass 'auto-shard': option 'mesh' is empty"),
    (["--dump-after", "unknownpass"], "--dump-after unknownpass: not a pass of this pipeline"),
    (["--mesh", "2", "--run-cpu", "0"], "--run-cpu 0: give the number of CPU ranks"),
    (["--memory-limit", "1GB"], "--memory-limit bounds the sharding plan: give --mesh too"),
    (["--mesh", "2", "--cluster", "."], "--cluster .: is a directory"),
    (["--out", ""], "--out: give a directory name"),
    (["--mesh", "2", "--pipeline", "2"], "--pipeline slices a training step into stages: add "
                                         "--mode train"),
    (["--mode", "train", "--pipeline", "2"], "--pipeline needs the devices to slice over"),
    (["--mode", "train", "--mesh", "2", "--pipeline", "x"], "--pipeline x: give 'auto' or a "
                                                            "number of stages"),
    (["--mode", "train", "--mesh", "2", "--pipeline", "2", "--trace", "t.json"],
     "--trace writes the measured timeline of a run: give --run-cpu too"),
]


def test_bad_options_fail_before_capture(out):
    before = snapshot(out)
    results = graphpar_each(*[["compile", MODEL, "--out", out, *argv]
                              for argv, _ in BAD_OPTIONS], cwd=out)
    for (_, says), result in zip(BAD_OPTIONS, results):
        assert result.returncode == 2, says
        assert says in error_line(result)
        assert "loading the model" not in result.stderr, "options are checked before loading"
    assert snapshot(out) == before


# --- 6. generate -------------------------------------------------------------------------------

BAD_GENERATE = [
    (["--max-tokens", "0"], "hello", "--max-tokens: must be >= 1, got 0"),
    (["--top-p", "2"], "hello", "--top-p: must be in (0, 1], got 2.0"),
    (["--stop-token-ids", "abc"], "hello", "--stop-token-ids 'abc': give token ids"),
    (["--swap-blocks", "-1"], "hello", "--swap-blocks must be at least 0, got -1"),
    ([], '{"prompt": "hi", "max_tokens": "ten"}', 'prompts.txt:2: "max_tokens": "ten" is not a '
                                                  'whole number'),
    ([], '{"prompt": "hi", "temperature": null}', 'prompts.txt:2: "temperature": null is not a '
                                                  'number'),
]


def test_bad_generate_options_fail_before_the_model_loads(tmp_path):
    runs = []
    for i, (argv, line, _) in enumerate(BAD_GENERATE):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "prompts.txt").write_text(f"hello\n{line}\n")
        runs.append(["generate", "--example", "gpt:tiny", "--prompts", f"{i}/prompts.txt",
                     "--out", f"{i}/results.jsonl", *argv])
    for i, ((_, _, says), result) in enumerate(zip(BAD_GENERATE, graphpar_each(*runs,
                                                                               cwd=tmp_path))):
        assert result.returncode == 2, says
        assert says in error_line(result)
        assert "loading the model" not in result.stderr
        assert [p.name for p in (tmp_path / str(i)).iterdir()] == ["prompts.txt"]


# --- 7. output and I/O ---------------------------------------------------------------------------

def test_outputs_that_are_not_folders_or_files(tmp_path, out):
    compile_, viz, generate = graphpar_each(
        ["compile", MODEL, "--out", "/dev/full"], ["viz", "--example", "mlp:tiny", "-o", out],
        ["generate", "--example", "gpt:tiny", "--prompts", MODEL, "--out", "/dev/full"])
    assert compile_.returncode == 2
    assert "--out /dev/full exists and is not a directory" in error_line(compile_)
    assert viz.returncode == 2 and f"-o '{out}': give a file name" in error_line(viz)
    assert generate.returncode == 2
    assert "--out /dev/full: exists and is not a regular file" in error_line(generate)
    assert [p.name for p in out.iterdir()] == ["report.json"], "no .tmp file left behind"


def test_a_closed_pipe_ends_quietly():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "graphpar.cli", "ops"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `graphpar ops | head -0` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err and "internal" not in err


def test_sigterm_during_compile_leaves_nothing(tmp_path, out):
    model = tmp_path / "slow.py"
    model.write_text("import time\nimport torch\n\nclass M(torch.nn.Module):\n"
                     "    def forward(self, x):\n        time.sleep(60)\n        return x * 2\n\n"
                     "def build():\n    return M(), (torch.randn(3),)\n")
    before = snapshot(out)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "graphpar.cli", "compile", str(model),
                             "--out", str(out)], env=env, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # wait until it is capturing: the staging folder exists
        if "capturing" in line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 143
    assert rest.strip().splitlines()[-1] == "graphpar: terminated"
    assert snapshot(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".graphpar-")]


@pytest.mark.parametrize("raised, says", [
    (OSError(errno.ENOSPC, "No space left on device", "/small/graph.html"),
     "no space left on the device (writing /small/graph.html)"),
    (MemoryError(), "ran out of memory (RAM)"),
])
def test_running_out_names_what_ran_out(tmp_path, capsys, monkeypatch, raised, says):
    """A full disk or exhausted memory is not a graphpar bug (in-process: neither can be
    provoked portably in a subprocess)."""
    def render(*args, **kwargs):
        raise raised

    monkeypatch.setattr("graphpar.viz.render_html", render)
    path = tmp_path / "g.gpir"
    path.write_text(GOOD_IR)
    assert main(["viz", str(path), "-o", str(tmp_path / "g.html")]) == 1
    err = capsys.readouterr().err
    assert says in err and "internal error" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.gpir"]


# --- 8. huge files fail fast ------------------------------------------------------------------

def test_an_error_near_the_top_of_a_huge_file_is_found_at_once(tmp_path):
    path = tmp_path / "huge.gpir"
    body = GOOD_IR.replace("  return", "  %2 = relu(%nope) : f32[8,16] {R,R}\n  return")
    path.write_text(body + "".join(GOOD_GRAPH.replace("@g", f"@g{i}") for i in range(60_000)))
    result = graphpar("dump", path, cwd=tmp_path)
    assert result.returncode == 1
    assert "huge.gpir:7:13: %nope is used before it is defined" in error_line(result)


# --- 9. smaller -----------------------------------------------------------------------------

def test_messages_name_options_not_internal_fields(tmp_path):
    import torch

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    generate = ["generate", "--example", "gpt:tiny", "--prompts", prompts, "--quiet"]
    kv, cuda = graphpar_each([*generate, "--kv-memory", "1KB"], [*generate, "--kernel", "cuda"])
    assert kv.returncode == 2
    assert "--kv-memory 1KB: holds no block of 16 tokens" in error_line(kv)
    assert "kv_cache_bytes" not in kv.stderr
    if not torch.cuda.is_available():
        assert cuda.returncode == 2
        assert "--kernel cuda: torch sees no CUDA GPU" in error_line(cuda)


def test_library_warnings_are_one_line_of_ours(capsys, monkeypatch):
    import warnings

    def ops(args):
        warnings.warn("a library\n  complains", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr("graphpar.cli.show.cmd_ops", ops)
    assert main(["ops"]) == 0
    err = capsys.readouterr().err
    assert err == "graphpar: warning: a library complains\n"
