"""Loads a user's model file by graphpar's convention.

A model file defines `build()`, returning the module and a tuple of example inputs:

    def build():
        return MyModel(), (torch.randn(8, 16),)

For `--mode train` it also defines `loss(output, *targets)` and `targets()` (a tuple of
tensors). `build()` may instead return a `graphpar.models.ExampleModel`-like object with
`module`, `inputs`, `loss_fn` and `targets` attributes.

As when it runs as `python model.py`, a model file may import modules next to it
(`from my_layers import Block`): its folder is on `sys.path` while it loads and builds.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from graphpar.compiler.driver import ModelSpec
from graphpar.compiler.meta_build import on_meta
from graphpar.errors import GraphparError, OutOfMemoryError, UsageError
from graphpar.models import memory
from graphpar.units import format_bytes

CONVENTION = ("a model file defines build() -> (module, example_inputs); for --mode train also "
              "loss(output, *targets) and targets() (see README, 'Model files')")

def _where(exc: BaseException, path: Path) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).resolve() == path.resolve()]
    if frames:
        return f"{path}:{frames[-1].lineno}: "
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{path}:{exc.lineno}: "
    return f"{path}: "


def _failed_import(exc: BaseException, path: Path) -> str:
    """For an import that found no module: which import it was, and in which file."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return ""
    frames = traceback.extract_tb(exc.__traceback__)
    importer = next((f for f in reversed(frames) if not f.filename.startswith("<frozen")),
                    None)
    where = f"{importer.filename}:{importer.lineno}" if importer else str(path)
    return (f" (the import of {exc.name!r} at {where} found no module; a model file can "
            f"import modules in its own folder, {path.resolve().parent})")


@contextmanager
def _own_folder_importable(path: Path) -> Iterator[None]:
    """The model file's folder first on sys.path, as `python model.py` would have it; on the
    way out the folder leaves sys.path and the neighbours imported from it leave
    sys.modules, so a second model file with a neighbour of the same name gets its own."""
    folder = str(path.resolve().parent)
    before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)
        for name in set(sys.modules) - before - {_module_name(path)}:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if file and Path(file).resolve().is_relative_to(folder):
                del sys.modules[name]


def load_model_file(path: str | Path, mode: str = "infer", weights: bool = True) -> ModelSpec:
    """The model a file's build() returns; targets() is called only for mode "train".

    With `weights=False` (planning: nothing will run) build() and targets() run on the meta
    device (`graphpar.compiler.meta_build`): no weights, no data, so a model of any size
    loads in seconds. With `weights=True`, or when build() cannot run on meta, it runs for
    real, after a memory check: the bytes a meta build made (or made before it failed) must
    fit the memory left, and every large tensor is checked again before it is allocated
    (`graphpar.models.memory.checked_allocations`)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file; {CONVENTION}")
    if path.is_dir():
        raise UsageError(f"{path}: is a directory, not a model file; {CONVENTION}")
    if path.suffix != ".py":
        raise UsageError(f"{path}: not a Python file; {CONVENTION}")
    with _own_folder_importable(path):
        module = _import(path)
        build = getattr(module, "build", None)
        if not callable(build):
            raise UsageError(f"{path}: no build() function found; {CONVENTION}")
        meta_failure, needed = None, 0
        with on_meta() as made:
            try:
                spec = _spec_from(_call_build(build, path), module, path, mode)
            except GraphparError as exc:
                meta_failure = exc
        needed = made.made
        if meta_failure is None and not weights:
            return spec
        what = f"{path}: build()"
        if meta_failure is not None:
            # the bytes made before it failed: a lower bound of what a real build makes
            why = str(meta_failure).removeprefix(f"{path}:").replace("build() failed: ", "")
            what = (f"{path}: build() cannot run on the meta device (line {why}), and "
                    f"building it for real")
            needed_text = f"at least {format_bytes(needed)}"
        else:
            needed_text = format_bytes(needed)
        available = memory.available_bytes()
        if available is not None and needed > available:
            raise OutOfMemoryError(f"{what} needs {needed_text} ({format_bytes(available)} "
                                   f"available); {_HOW_TO_AVOID[weights]}")
        with memory.checked_allocations(what, how_to_avoid=_HOW_TO_AVOID[weights]):
            return _spec_from(_call_build(build, path), module, path, mode)


_HOW_TO_AVOID = {
    True: ("running a model needs its weights: leave out --run-cpu to plan only (planning "
           "builds on the meta device), or make the model smaller"),
    False: ("planning needs no weights: make build() run on the meta device (no .item() or "
            "branch on a tensor's value, no weights file read) and graphpar builds it there"),
}


def _call_build(build, path: Path):
    try:
        return build()
    except GraphparError:
        raise
    except Exception as exc:
        raise UsageError(f"{_where(exc, path)}build() failed: {type(exc).__name__}: {exc}"
                         f"{_failed_import(exc, path)}") from None


def _module_name(path: Path) -> str:
    return f"graphpar_user_model_{abs(hash(str(path.resolve())))}"


def _import(path: Path):
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (GraphparError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # SystemExit too: a model file that exits is the user's
        raise UsageError(f"{_where(exc, path)}importing the model file failed: "
                         f"{type(exc).__name__}: {exc}{_failed_import(exc, path)}") from None
    return module


def _spec_from(built, module, path: Path, mode: str) -> ModelSpec:
    if hasattr(built, "module") and hasattr(built, "inputs"):
        model, inputs = built.module, built.inputs
        loss_fn = getattr(built, "loss_fn", None)
        targets = getattr(built, "targets", ()) if mode == "train" else ()
    elif isinstance(built, tuple) and len(built) == 2:
        model, inputs = built
        loss_fn, targets = getattr(module, "loss", None), ()
        if mode == "train" and callable(getattr(module, "targets", None)):
            targets = _call_targets(module.targets, path)
    else:
        raise UsageError(f"{path}: build() returned {type(built).__name__}; {CONVENTION}")
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{path}: build() returned {type(model).__name__} as the model, not a "
                         f"torch.nn.Module; {CONVENTION}")
    return ModelSpec(path.stem, model, _tensors(inputs, "build()'s example inputs", path),
                     loss_fn, _tensors(targets, "targets()", path), str(path))


def _call_targets(targets, path: Path):
    try:
        return targets()
    except GraphparError:
        raise
    except Exception as exc:
        raise UsageError(f"{_where(exc, path)}targets() failed: {type(exc).__name__}: {exc}"
                         ) from None


def _tensors(value, what: str, path: Path) -> tuple[torch.Tensor, ...]:
    """A tensor, or a tuple or list of tensors, as a tuple; anything else is a UsageError."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(t, torch.Tensor)
                                                       for t in value):
        raise UsageError(f"{path}: {what} must be a tuple of tensors, got "
                         f"{type(value).__name__}; {CONVENTION}")
    return tuple(value)


def model_function(path: str | Path, name: str):
    """The function `name` a model file defines (e.g. `batch`), or None; the file is imported
    with its folder importable, as `load_model_file` does, but nothing is built."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file; {CONVENTION}")
    with _own_folder_importable(path):
        module = sys.modules.get(_module_name(path)) or _import(path)
    function = getattr(module, name, None)
    return function if callable(function) else None
