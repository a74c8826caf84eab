"""What every graphpar command shares: progress lines, atomic output files, model loading."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING

from graphpar.errors import OutputError, UsageError

if TYPE_CHECKING:  # imported at run time, inside the functions, like the rest of the CLI
    from graphpar.cost.limits import PlanLimits
    from graphpar.ir.cluster import Cluster
    from graphpar.ir.mesh import Mesh

DEFAULT_EXAMPLE = "gpt:125M"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors exit 2 like ours
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _progress(message: str) -> None:
    print(f"graphpar: {message}", file=sys.stderr, flush=True)


@contextmanager
def step(what: str) -> Iterator[None]:
    """Announce a step, and its time when it took over a second."""
    _progress(f"{what} ...")
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    if seconds > 1.0:
        _progress(f"{what}: done in {seconds:.1f} s")


def progress_printer() -> Callable[[str, int, int], None]:
    """`on_progress(stage, done, total)` for long loads: a line at most once a second, and
    only once the work has taken a second."""
    start = last = time.perf_counter()

    def report(stage: str, done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - start > 1.0 and now - last > 1.0:
            last = now
            unit = "bytes" if stage == "parsing" else "nodes"
            _progress(f"{stage}: {done:,} of {total:,} {unit} ({now - start:.0f} s)")
    return report


class ProgressBar:
    """`[######----]  12/60 what` on stderr, redrawn in place; only on a terminal."""

    def __init__(self, total: int, title: str, enabled: bool = True, width: int = 30) -> None:
        self.total, self.title, self.width, self.done = max(1, total), title, width, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def advance(self, what: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = min(self.width, self.width * self.done // self.total)
        line = (f"\r{self.title} [{'#' * filled}{'-' * (self.width - filled)}] "
                f"{self.done}/{self.total} {time.perf_counter() - self.start:4.0f} s  {what}")
        print(f"{line[:shutil.get_terminal_size().columns - 1]:<80}", end="", file=sys.stderr,
              flush=True)

    def close(self) -> None:
        if self.enabled and self.done:
            print(file=sys.stderr, flush=True)


def check_output_file(path: Path, option: str) -> None:
    """Refuse an output file path that cannot be one, before any slow work."""
    if not str(path) or path.is_dir():
        raise UsageError(f"{option} {str(path)!r}: give a file name, not a directory")
    if path.exists() and not path.is_file():  # a device or pipe: never rename over it
        raise UsageError(f"{option} {path}: exists and is not a regular file; give a file name")
    if not path.absolute().parent.is_dir():
        raise OutputError(f"{path}: cannot write {option} there: "
                          f"{path.absolute().parent} is not a folder")


@contextmanager
def atomic_output(path: str | os.PathLike[str], option: str) -> Iterator[IO[str]]:
    """A text file that appears at `path` only once the block finishes: it is written next to
    it and renamed over it, so a failure or an interrupt leaves nothing half-written."""
    path = Path(path)
    check_output_file(path, option)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                   dir=path.parent if str(path.parent) else ".")
    except OSError as exc:
        raise OutputError(f"{path}: cannot write {option} there: {exc.strerror or exc}"
                          ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            yield file
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def example_spec(text: str, train: bool = False, batch: int | None = None,
                 seq_len: int | None = None):
    """`gpt` or `gpt:125M` -> the bundled example model as a ModelSpec (in train mode for
    `train`: batch norm then normalizes by the batch, as a training step does). The module is
    built on the meta device, so a model of any size compiles; its real weights, the same as
    a CPU build's, are made only to run it (`ModelSpec.real_module`). The example batch is
    real: `batch` sequences or samples (default 2) of `seq_len` tokens (default the
    preset's, for token models: it is also the model's context length)."""
    from graphpar.compiler.driver import ModelSpec
    from graphpar.models import example_batch, get_model

    name, _, preset = text.partition(":")
    overrides = {} if seq_len is None else {"seq_len": seq_len}
    example = get_model(name, preset or "tiny", train=train, device="meta", **overrides)
    inputs, targets = example_batch(name, example.config, batch_size=batch or 2)
    return ModelSpec(f"{name}_{example.preset}", example.module, tuple(inputs),
                     example.loss_fn, tuple(targets),
                     f"graphpar.models:{name}/{example.preset}",
                     make_real=lambda: get_model(name, example.preset, train=train,
                                                 **overrides).module)


def load_target(path: str | None, example: str | None, mode: str = "infer", *,
                weights: bool = True, batch: int | None = None, seq_len: int | None = None):
    """The model a command works on: a model file, or --example (default DEFAULT_EXAMPLE)
    at --batch and --seq-len. `weights=False` when nothing will run: a model file is then
    built on the meta device (`load_model_file`)."""
    from graphpar.compiler.model_file import load_model_file

    if path and example:
        raise UsageError("give a model file or --example, not both")
    if example or not path:
        return example_spec(example or DEFAULT_EXAMPLE, mode == "train", batch, seq_len)
    for option, value in (("--batch", batch), ("--seq-len", seq_len)):
        if value is not None:
            raise UsageError(f"{option} {value}: only for a bundled --example; a model file's "
                             f"build() decides its own example inputs ({path}: change the "
                             "shapes it returns)")
    return load_model_file(path, mode, weights=weights)


def check_size_options(args: argparse.Namespace) -> None:
    """--batch and --seq-len, before any slow work: positive, --seq-len for token models."""
    target = getattr(args, "model", None) or getattr(args, "target", None)
    for option in ("batch", "seq_len"):
        value = getattr(args, option, None)
        name = f"--{option.replace('_', '-')} {value}"
        if value is not None and value < 1:
            raise UsageError(f"{name}: give at least 1")
        if value is not None and target and not getattr(args, "example", None):
            raise UsageError(f"{name}: only for a bundled --example; {target} decides its own "
                             "example inputs (a model file's build() returns them)")
    if getattr(args, "seq_len", None) is not None and getattr(args, "example", None):
        import dataclasses

        from graphpar.models import get_config

        name, _, preset = args.example.partition(":")
        config = get_config(name, preset or "tiny")
        if "seq_len" not in {f.name for f in dataclasses.fields(config)}:
            raise UsageError(f"--seq-len {args.seq_len}: {args.example} is not a token model "
                             "(its inputs have no sequence); give --batch alone")


def _names(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",")] if value else []


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path if path.is_dir() else path.parent


def staging_dir(out: Path) -> Path:
    """A fresh directory beside `out` where a command writes its files before `_publish`."""
    try:
        return Path(tempfile.mkdtemp(prefix=".graphpar-", dir=_existing_parent(out)))
    except OSError as exc:
        raise OutputError(f"{out}: cannot write --out there: {exc.strerror or exc}") from None


def check_output_dir(out: str, option: str = "--out", files: tuple[str, ...] = ()) -> Path:
    """Refuse an output folder that cannot be one, before any slow work: an empty name, a
    file, a path through a file, or (for `files`, the names the command writes there) a
    folder or device where one of its files goes."""
    if not out:
        raise UsageError(f"{option}: give a directory name")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} exists and is not a directory; give a directory")
    if not _existing_parent(path).is_dir() or (path.parent.exists()
                                               and not path.parent.is_dir()):
        raise OutputError(f"{path}: cannot write {option} there: a path component is a file")
    for name in files:
        target = path / name
        if target.exists() and not target.is_file():
            raise UsageError(f"{option} {path}: {target} exists and is not a file; remove it "
                             f"or give another {option}")
    return path


def _publish(staging: Path, out: Path) -> None:
    """Move finished files into `out`: a failed compile leaves nothing half-written there.
    Ctrl-C and SIGTERM wait until every file is moved, so `out` is never half-updated."""
    import signal

    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    held = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for item in staging.iterdir():
            target = out / item.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(item, target)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


@contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A fresh folder beside `out` where a command writes its files (`publish_report` moves
    them into `out`), removed when the block ends: a failed command leaves nothing
    half-written in `out`."""
    staging = staging_dir(out)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, out: Path) -> None:
    """Every file staged moved into `out` as one output (`staged_output`)."""
    _publish(staging, out)


def publish_report(summary: dict, staging: Path, out: Path) -> None:
    """`summary` written as report.json beside the staged files, which it lists (`files`,
    report.json with them), and everything moved into `out`."""
    import json

    summary["files"] = sorted(str(p.relative_to(staging)) for p in staging.rglob("*")
                              if p.is_file()) + ["report.json"]
    (staging / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    _publish(staging, out)


TIMED_STEPS, WARMUP_STEPS = 5, 2  # --run-cpu's step timing: the median of 5 after 2 untimed


def step_time_report(measured: dict, estimated: float) -> dict:
    """Measured step time (`StepTimes.as_dict`) beside its estimate, and their ratio
    (measured / estimated)."""
    return {**measured, "step_seconds_estimated": estimated,
            "step_time_ratio": (measured["step_seconds_measured"] / estimated
                                if estimated > 0 else None)}


def step_time_line(r: dict) -> str:
    """`step time  X ms measured (median of K), Y ms estimated, ratio Z`."""
    ratio = "n/a" if r["step_time_ratio"] is None else f"{r['step_time_ratio']:.3g}"
    return (f"step time  {r['step_seconds_measured'] * 1e3:.3f} ms measured (median of "
            f"{r['steps']}, min {r['step_seconds_min'] * 1e3:.3f} ms), "
            f"{r['step_seconds_estimated'] * 1e3:.3f} ms estimated, ratio {ratio}")


def bytes_sent_text(counted: float | None, logical: float, predicted: float) -> str:
    """`X counted (gloo payloads), Y by the plan's definition, Z predicted`: the payloads the
    ranks handed to gloo, the same run's bytes by the cost model's definition of each
    collective (equal to the prediction by construction), and the plan's prediction."""
    wire = ("not counted (no process group)" if counted is None
            else f"{counted:,.0f} counted (gloo payloads)")
    return f"{wire}, {logical:,.0f} by the plan's definition, {predicted:,.0f} predicted"


LIMIT_OPTIONS = ("--memory-limit ", "--time-limit ")  # how a bad limit is named in errors


def check_plan_options(args: argparse.Namespace) -> None:
    """Usage errors in the sharding plan's options (--time-limit, --memory-limit, a --cluster
    file), found before the model is loaded."""
    from graphpar.cost.cluster import PRESETS
    from graphpar.cost.limits import DEFAULT_MEMORY, DEFAULT_TIME_SECONDS, PlanLimits

    PlanLimits.check(args.memory_limit or DEFAULT_MEMORY,
                     args.time_limit if args.time_limit is not None else DEFAULT_TIME_SECONDS,
                     options=LIMIT_OPTIONS)

    if args.cluster not in PRESETS and Path(args.cluster).exists():  # a file, not a preset
        from graphpar.errors import GraphparError
        from graphpar.ir.parser import read_text_file

        try:
            read_text_file(Path(args.cluster), "cluster JSON file")
        except GraphparError as exc:
            raise UsageError(f"--cluster {exc}") from None


def plan_mesh(args: argparse.Namespace) -> Mesh:
    """--mesh laid on --cluster, read once: the `Mesh` every pass and stage re-solve takes; a
    bad mesh is a usage error naming the option."""
    from graphpar.cost.cluster import mesh_for
    from graphpar.errors import ShardingError

    try:
        return mesh_for(args.mesh, args.cluster)
    except ShardingError as exc:
        raise UsageError(f"--mesh {args.mesh}: {exc}") from None


def plan_limits(args: argparse.Namespace, cluster: Cluster | str | None = None) -> PlanLimits:
    """--memory-limit and --time-limit with their defaults (the device's memory, 30 s), read
    once into the `PlanLimits` every ILP is solved under ("device" is the memory per device
    of `cluster`, default --cluster); a bad one is a usage error naming its option."""
    from graphpar.cost.limits import DEFAULT_MEMORY, DEFAULT_TIME_SECONDS, PlanLimits

    return PlanLimits.parse(
        args.memory_limit or DEFAULT_MEMORY,
        args.time_limit if args.time_limit is not None else DEFAULT_TIME_SECONDS,
        cluster or args.cluster, options=LIMIT_OPTIONS)


def auto_shard_pass(args: argparse.Namespace):
    """The `auto-shard` pass that --mesh, --cluster, --memory-limit and --time-limit ask for,
    on the objects they are read into once (`plan_mesh`, `plan_limits`)."""
    from graphpar.passes.autoshard import AutoShard

    mesh = plan_mesh(args)
    return AutoShard.of(mesh, plan_limits(args, mesh.cluster))


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The model to capture, as compile and explain take it: a file or --example, a mode."""
    parser.add_argument("model", nargs="?", help="model file defining build() (see README)")
    parser.add_argument("--example", help=f"a bundled model instead, e.g. gpt:125M (default "
                                          f"when no file is given: {DEFAULT_EXAMPLE})")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    add_size_options(parser)


def add_size_options(parser: argparse.ArgumentParser) -> None:
    """--batch and --seq-len: the example batch of a bundled --example."""
    parser.add_argument("--batch", type=int, metavar="N",
                        help="with --example: the global batch, in sequences or samples "
                             "(default 2); a model file's build() decides its own")
    parser.add_argument("--seq-len", type=int, metavar="L",
                        help="with --example, a token model: tokens per sequence, also the "
                             "model's context length (default the preset's)")


def add_plan_options(parser: argparse.ArgumentParser, mesh_help: str) -> None:
    """--mesh, --cluster, --memory-limit and --time-limit: the auto-shard plan's options."""
    parser.add_argument("--mesh", help=mesh_help)
    parser.add_argument("--cluster", default="dgx-a100",
                        help="cluster preset (dgx-a100, dgx-a100-80gb, dgx-h100, p3.16xlarge, cpu, "
                             "cpu-gloo) or a JSON file")
    parser.add_argument("--memory-limit",
                        help="per-device memory the plan must fit: a size like 40GB, 'device' "
                             "(the cluster's device memory, the default) or 'none'")
    parser.add_argument("--time-limit", type=float,
                        help="auto-shard time limit, seconds: building and solving the ILP "
                             "(default 30)")


def add_pipeline_options(parser: argparse.ArgumentParser, what: str) -> None:
    """--pipeline, --microbatches, --schedule and --token-slices, as compile and viz take them."""
    parser.add_argument("--pipeline", metavar="auto|S", help=what)
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per step with --pipeline (default: 4, or the "
                             "largest number below 4 that divides the batch)")
    parser.add_argument("--power-of-two-hosts", action="store_true",
                        help="with --pipeline: stages span 1, 2, 4, 8 ... hosts only, as Alpa's "
                             "search does (fewer ILP solves on many hosts)")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "zb"], default=None,
                        help="pipeline schedule with --pipeline (default 1f1b; zb: ZB-H1)")
    parser.add_argument("--token-slices", metavar="auto|N",
                        help="with --pipeline, a causal LM: cut each sequence into token slices "
                             "that flow through the stages one after another (TeraPipe): 'auto' "
                             "(the DP) or N equal slices")


def certified(*checks: dict | None) -> int:
    """The exit status of a run whose plan was checked: 1 when a check found a difference
    beyond rounding (its verdict says where), else 0."""
    failed = [c for c in checks if c is not None and c.get("within_tolerance") is False]
    if failed:
        import sys

        print("graphpar: the plan's results differ from eager PyTorch beyond float32 rounding "
              "(see the verdict above and report.json)", file=sys.stderr)
        return 1
    return 0
