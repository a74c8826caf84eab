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


def load_model_file(path: str | Path) -> ModelSpec:
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file; {CONVENTION}")
    if path.suffix != ".py":
        raise UsageError(f"{path}: not a Python file; {CONVENTION}")
    name = f"graphpar_user_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except GraphparError:
        raise
    except BaseException as exc:
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
    return _spec_from(built, module, path)


def _spec_from(built, module, path: Path) -> ModelSpec:
    if hasattr(built, "module") and hasattr(built, "inputs"):
        model, inputs = built.module, built.inputs
        loss_fn = getattr(built, "loss_fn", None)
        targets = getattr(built, "targets", ())
    elif isinstance(built, tuple) and len(built) == 2:
        model, inputs = built
        loss_fn, targets = getattr(module, "loss", None), ()
        if callable(getattr(module, "targets", None)):
            targets = module.targets()
    else:
        raise UsageError(f"{path}: build() returned {type(built).__name__}; {CONVENTION}")
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{path}: build() returned {type(model).__name__} as the model, not a "
                         f"torch.nn.Module; {CONVENTION}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise UsageError(f"{path}: build()'s example inputs must be a tuple of tensors")
    return ModelSpec(path.stem, model, tuple(inputs), loss_fn, tuple(targets), str(path))
