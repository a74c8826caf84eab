"""Optimizer updates written into the training graph, so passes can shard optimizer state.

Each optimizer emits, per parameter, the IR of one `torch.optim` step (same formulas, same
defaults), taking the gradient value and its state inputs and returning the new parameter and
new state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphpar.errors import UsageError
from graphpar.ir.graph import Graph, OutputRole, Role, Value
from graphpar.ir.types import TensorType


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD with optional momentum and weight decay."""

    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0

    def state_names(self, param: str) -> list[str]:
        return [f"{param}.momentum_buffer"] if self.momentum else []

    def emit(self, graph: Graph, param: Value, grad: Value, state: list[Value], step: Value | None
             ) -> tuple[Value, list[Value]]:
        g = grad
        if self.weight_decay:
            g = _op(graph, "add", g, _op(graph, "mul", param, self.weight_decay))
        new_state = []
        if self.momentum:
            # torch starts the buffer at the first gradient; with a zero-initialized buffer the
            # first step is buf = 0·momentum + g, the same thing.
            buf = _op(graph, "add", _op(graph, "mul", state[0], self.momentum), g)
            new_state, g = [buf], buf
        return _op(graph, "sub", param, _op(graph, "mul", g, self.lr)), new_state

    def reference(self, params):
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)


@dataclass(frozen=True)
class Adam:
    """torch.optim.Adam (single-tensor form, no amsgrad)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def state_names(self, param: str) -> list[str]:
        return [f"{param}.exp_avg", f"{param}.exp_avg_sq"]

    def emit(self, graph: Graph, param: Value, grad: Value, state: list[Value], step: Value
             ) -> tuple[Value, list[Value]]:
        g = grad
        if self.weight_decay:
            g = _op(graph, "add", g, _op(graph, "mul", param, self.weight_decay))
        m, v = state
        m = _op(graph, "add", m, _op(graph, "mul", _op(graph, "sub", g, m), 1 - self.beta1))
        v = _op(graph, "add", _op(graph, "mul", v, self.beta2),
                _op(graph, "mul", _op(graph, "mul", g, g), 1 - self.beta2))
        bias1 = _bias_correction(graph, self.beta1, step)
        bias2_sqrt = _op(graph, "sqrt", _bias_correction(graph, self.beta2, step))
        denom = _op(graph, "add", _op(graph, "div", _op(graph, "sqrt", v), bias2_sqrt), self.eps)
        step_size = _op(graph, "div", self.lr, bias1)
        update = _op(graph, "mul", _op(graph, "div", m, denom), step_size)
        return _op(graph, "sub", param, update), [m, v]

    def reference(self, params):
        return torch.optim.Adam(params, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps,
                                weight_decay=self.weight_decay, foreach=False)


def _bias_correction(graph: Graph, beta: float, step: Value) -> Value:
    """1 - beta**step, computed as -expm1(step * ln(beta)) with ln(beta) taken in float64.

    In float32, 1 - beta**step cancels: beta = 0.999 is stored with a relative error of up to
    2**-24, which 1 - beta multiplies by beta / (1 - beta) = 999, so the first steps' updates
    would be off by up to 6e-5 of themselves, more than any other rounding of the step. Each
    operation of this form rounds once, relative to its own result: a few 2**-24 in all."""
    return _op(graph, "mul", _op(graph, "expm1", _op(graph, "mul", step, math.log(beta))), -1.0)


Optimizer = SGD | Adam
STEP = "optim.step"  # the shared step counter input of optimizers that need one


def optimizer_from_name(name: str, lr: float | None = None) -> Optimizer:
    kinds = {"sgd": SGD, "adam": Adam}
    if name not in kinds:
        raise UsageError(f"unknown optimizer {name!r}; choose one of {', '.join(kinds)}")
    return kinds[name]() if lr is None else kinds[name](lr=lr)


def _op(graph: Graph, op: str, *operands, module: str = "optimizer") -> Value:
    return graph.create(op, list(operands), module=module).output


def append_optimizer(graph: Graph, optimizer: Optimizer, state: dict[str, torch.Tensor],
                     keep_grads: bool = False) -> None:
    """Replace the graph's grad outputs by the optimizer step: new params and new state.

    New optimizer-state inputs get zero tensors in `state`, as torch.optim starts them.
    """
    grads = [o for o in graph.outputs if o.role is OutputRole.GRAD]
    if not grads:
        raise UsageError(f"graph @{graph.name} has no gradients to apply an optimizer to")
    step = None
    # Moments of meta parameters (a capture without weights) are meta too: shapes, no bytes.
    device = "meta" if any(t.is_meta for t in state.values()) else "cpu"
    if isinstance(optimizer, Adam):
        step_in = graph.add_input(STEP, TensorType((), torch.float32), Role.OPTIM_STATE)
        state[STEP] = torch.zeros((), device=device)
        step = _op(graph, "add", step_in, 1.0)
        graph.add_output(step, OutputRole.UPDATE, STEP)
    if not keep_grads:
        graph.outputs = [o for o in graph.outputs if o.role is not OutputRole.GRAD]
    inputs = graph.inputs_by_name()
    for out in grads:
        param = inputs[out.target]
        slots = []
        for name in optimizer.state_names(param.name):
            slots.append(graph.add_input(name, param.type, Role.OPTIM_STATE))
            state[name] = torch.zeros(param.type.shape, dtype=param.type.dtype, device=device)
        last = next(reversed(graph.nodes), None)
        new_param, new_slots = optimizer.emit(graph, param, out.value, slots, step)
        for node in graph.nodes.after(last):  # grouped per parameter: "optimizer.blocks.0.fc"
            node.module = f"optimizer.{param.name.rsplit('.', 1)[0]}"
        graph.add_output(new_param, OutputRole.UPDATE, param.name)
        for slot, new in zip(slots, new_slots):
            graph.add_output(new, OutputRole.UPDATE, slot.name)
