"""Capture without weights: a module built on the meta device is traced with fake tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphpar.errors import GraphparError
from graphpar.ir.graph import Graph, Role


def has_meta_tensors(module: torch.nn.Module, args: Sequence[torch.Tensor] = ()) -> bool:
    """Whether `module` (or an argument) holds tensors with shapes but no data."""
    tensors = [*module.parameters(), *module.buffers(), *args]
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


@contextmanager
def fake_tensors(module: torch.nn.Module, args: Sequence[torch.Tensor]
                 ) -> Iterator[tuple[torch.Tensor, ...]]:
    """For the block, `module`'s parameters and buffers are fake CPU tensors of the same
    shapes, dtypes, strides and ties (one fake per distinct tensor, as torch.export needs to
    see a tied weight as one), and the yielded arguments are fakes of `args`. torch.export
    traces them as it would real ones and allocates nothing; on the way out the module gets
    its own tensors back. Meta tensors held as plain attributes (constants a module made on
    the meta device) are faked too. This is torchtitan's build-on-meta, with autoparallel's
    move of the parameters to fake for tracing."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            with mode:
                made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                           device="cpu")
            if isinstance(tensor, torch.nn.Parameter):
                made = torch.nn.Parameter(made, requires_grad=tensor.requires_grad)
            fakes[id(tensor)] = made
        return fakes[id(tensor)]

    swapped = []  # (the dict a tensor lives in, its key, the tensor)
    try:
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for key, tensor in table.items():
                    if tensor is not None:
                        swapped.append((table, key, tensor))
                        table[key] = fake(tensor)
            constants = [(key, t) for key, t in vars(sub).items()  # plain tensor attributes
                         if isinstance(t, torch.Tensor) and t.is_meta]
            for key, tensor in constants:
                swapped.append((vars(sub), key, tensor))
                vars(sub)[key] = fake(tensor)
        yield tuple(fake(a) if a.is_meta else mode.from_tensor(a) for a in args)
    finally:
        for table, key, tensor in swapped:
            table[key] = tensor


def abstract_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Meta tensors in place of a fake capture's state: shapes and dtypes, no data."""
    return {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for name, t in state.items()}


def real_state(graph: Graph, state: dict[str, torch.Tensor]
               ) -> Callable[[torch.nn.Module], dict[str, torch.Tensor]]:
    """How to make the real tensors of a weightless capture's `state` once its module holds
    real weights: parameters, buffers and constants from the module by their names,
    optimizer state at zero as torch.optim starts it. The roles are read now, before passes
    change the graph."""
    optimizer_state = {v.name for v in graph.inputs if v.role is Role.OPTIM_STATE}
    shapes = dict(state)

    def make(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        real = {}
        for name, tensor in shapes.items():
            if not tensor.is_meta:
                real[name] = tensor
            elif name in optimizer_state:
                real[name] = torch.zeros(tensor.shape, dtype=tensor.dtype)
            else:
                real[name] = _module_tensor(module, name, graph.name).detach()
        return real
    return make


def _module_tensor(module: torch.nn.Module, name: str, graph_name: str) -> torch.Tensor:
    owner_path, _, attr = name.rpartition(".")
    try:
        tensor = getattr(module.get_submodule(owner_path), attr)
    except AttributeError:
        tensor = None
    if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
        raise GraphparError(f"graph @{graph_name} needs {name}, which the module it was "
                            "captured from does not hold as real tensor: give its weights "
                            "before running the graph")
    return tensor
