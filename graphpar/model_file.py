"""Loads a user's model file by graphpar's convention.

A model file defines `build()`, returning the module and a tuple of example inputs:

    def build():
        return MyModel(), (torch.randn(8, 16),)

For `--mode train` it also defines `loss(output, *targets)` and `targets()` (a tuple of
tensors). `build()` may instead return a `graphpar.models.ExampleModel`-like object with
`module`, `inputs`, `loss_fn` and `targets` attributes.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

import torch

from graphpar.compiler import ModelSpec
from graphpar.errors import GraphparError, UsageError

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


def load_model_file(path: str | Path, mode: str = "infer") -> ModelSpec:
    """The model a file's build() returns; targets() is called only for mode "train"."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file; {CONVENTION}")
    if path.is_dir():
        raise UsageError(f"{path}: is a directory, not a model file; {CONVENTION}")
    if path.suffix != ".py":
        raise UsageError(f"{path}: not a Python file; {CONVENTION}")
    name = f"graphpar_user_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (GraphparError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # SystemExit too: a model file that exits is the user's
        raise UsageError(f"{_where(exc, path)}importing the model file failed: "
                         f"{type(exc).__name__}: {exc}") from None
    build = getattr(module, "build", None)
    if not callable(build):
        raise UsageError(f"{path}: no build() function found; {CONVENTION}")
    try:
        built = build()
    except GraphparError:
        raise
    except Exception as exc:
        raise UsageError(f"{_where(exc, path)}build() failed: {type(exc).__name__}: {exc}"
                         ) from None
    return _spec_from(built, module, path, mode)


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
