"""Example models bundled with graphpar, by name and preset, with inputs, targets and a loss.

Every model module (mlp, gpt, llama, bert, moe, wide_resnet) defines the same five things:

- a frozen config dataclass and ``PRESETS: dict[str, Config]`` ("tiny" is for tests);
- ``build(config, seed=0) -> nn.Module``, weights drawn from ``seed`` without touching the
  caller's RNG state;
- ``example_batch(config, batch_size, generator) -> (inputs, targets)``;
- ``loss_fn(output, *targets) -> scalar``;
- ``param_count(config) -> int``, computed from the config alone (no weights allocated).

``get_model`` puts them together::

    spec = get_model("gpt", "tiny")
    torch.export.export(spec.module, spec.inputs)                 # inference capture
    loss = spec.loss_fn(spec.module(*spec.inputs), *spec.targets)  # one training step's loss

Language models take token ids [B, S] and return logits [B, S, V]; their target is a separate
labels tensor holding the next token at every position (drawn together with the inputs from one
[B, S+1] sequence), so the loss is a plain cross entropy with no shifting inside the graph.
No model has dropout; the only train/eval difference is BatchNorm in wide_resnet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from graphpar.errors import UsageError
from graphpar.models import bert, gpt, llama, mlp, moe, wide_resnet
from graphpar.models.memory import materialize

_FAMILIES: dict[str, ModuleType] = {
    "mlp": mlp,
    "gpt": gpt,
    "llama": llama,
    "bert": bert,
    "moe": moe,
    "wide_resnet": wide_resnet,
}
MODEL_NAMES: tuple[str, ...] = tuple(_FAMILIES)

Tensors = tuple[torch.Tensor, ...]


@dataclass
class ExampleModel:
    """A built model with one example batch: module(*inputs), loss_fn(output, *targets)."""

    name: str
    preset: str
    config: Any
    module: nn.Module
    inputs: Tensors
    targets: Tensors
    loss_fn: Callable[..., torch.Tensor]

    def loss(self, output: Any) -> torch.Tensor:
        """The training loss of a module output against this batch's targets."""
        return self.loss_fn(output, *self.targets)

    def training_loss(self) -> torch.Tensor:
        """Run the module on the example inputs and return the loss (one training step)."""
        return self.loss(self.module(*self.inputs))


def _family(model_name: str) -> ModuleType:
    if model_name not in _FAMILIES:
        raise UsageError(
            f"unknown model {model_name!r}; available models: {', '.join(MODEL_NAMES)}"
        )
    return _FAMILIES[model_name]


def presets(model_name: str) -> dict[str, Any]:
    """The named configs of a model, e.g. presets("gpt")["1.3B"]."""
    return dict(_family(model_name).PRESETS)


def get_config(model_name: str, preset: str = "tiny", **overrides: Any) -> Any:
    """A preset's config, with fields replaced by `overrides` (e.g. n_layers=4)."""
    table = _family(model_name).PRESETS
    if preset not in table:
        raise UsageError(
            f"unknown preset {preset!r} for model {model_name!r}; "
            f"available presets: {', '.join(table)}"
        )
    config = table[preset]
    fields = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise UsageError(
            f"unknown config field(s) {', '.join(unknown)} for model {model_name!r}; "
            f"fields: {', '.join(fields)}"
        )
    return dataclasses.replace(config, **overrides)


def _check_config(model_name: str, config: Any) -> ModuleType:
    family = _family(model_name)
    expected = type(next(iter(family.PRESETS.values())))
    if not isinstance(config, expected):
        raise UsageError(
            f"model {model_name!r} takes a {expected.__name__}, got {type(config).__name__}"
        )
    return family


def build(model_name: str, config: Any, seed: int = 0) -> nn.Module:
    """The model's module, weights drawn from `seed`, in training mode (PyTorch's default)."""
    return _check_config(model_name, config).build(config, seed)


def example_batch(
    model_name: str, config: Any, batch_size: int = 2, seed: int = 0
) -> tuple[Tensors, Tensors]:
    """(inputs, targets) for one batch, drawn from a private generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return _check_config(model_name, config).example_batch(config, batch_size, generator)


def example_inputs(model_name: str, config: Any, batch_size: int = 2, seed: int = 0) -> Tensors:
    """The forward inputs of example_batch(...)."""
    return example_batch(model_name, config, batch_size, seed)[0]


def example_targets(model_name: str, config: Any, batch_size: int = 2, seed: int = 0) -> Tensors:
    """The training targets of example_batch(...), matching example_inputs with the same seed."""
    return example_batch(model_name, config, batch_size, seed)[1]


def loss_fn(model_name: str) -> Callable[..., torch.Tensor]:
    """The model's training loss: loss_fn(output, *targets) -> scalar."""
    return _family(model_name).loss_fn


def param_count(model_name: str, config: Any) -> int:
    """Number of parameters of build(model_name, config), computed without building it."""
    return _check_config(model_name, config).param_count(config)


def get_model(
    model_name: str,
    preset: str = "tiny",
    *,
    batch_size: int = 2,
    seed: int = 0,
    train: bool = False,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> ExampleModel:
    """Build a model from a preset (plus config overrides) with one example batch.

    The module is in eval mode unless train=True. Weights and inputs are drawn on the CPU from
    `seed`, then moved to `device`, so every device gets the same values; device="meta" builds
    a weightless module of any size (for capture and planning). dtype casts floating-point
    parameters, buffers, inputs and targets; token ids and labels stay int64.
    """
    config = get_config(model_name, preset, **overrides)
    device = torch.device(device)
    if device.type == "meta":
        with torch.device("meta"):
            module = build(model_name, config, seed)
    else:
        itemsize = (dtype or torch.get_default_dtype()).itemsize
        module = materialize(f"the weights of {model_name}:{preset}",
                             param_count(model_name, config) * max(itemsize, 4),
                             lambda: build(model_name, config, seed).to(device))
    module.train(train)
    if dtype is not None:
        module.to(dtype)
    inputs, targets = example_batch(model_name, config, batch_size, seed)

    def place(t: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else None
        return t.to(device=device, dtype=cast)

    return ExampleModel(
        name=model_name,
        preset=preset,
        config=config,
        module=module,
        inputs=tuple(place(t) for t in inputs),
        targets=tuple(place(t) for t in targets),
        loss_fn=loss_fn(model_name),
    )
