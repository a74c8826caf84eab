"""Compare one run of a compiled graph with eager PyTorch and torch.optim, worst error per kind."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphpar.capture.optim import STEP, Adam, Optimizer
from graphpar.errors import GraphparError
from graphpar.ir.graph import Output, OutputRole

if TYPE_CHECKING:
    from graphpar.compiler import ModelSpec

__all__ = ["KINDS", "REDUCTION_RTOL", "EagerCheck", "WorstError", "allowed_errors",
           "check_against_eager", "eager_results", "step_results"]

# What a graph output can be, in report order: inference outputs, then a training step's loss,
# gradients, updated parameters, new optimizer state and mutated buffers (batch-norm statistics).
KINDS = ("outputs", "loss", "gradients", "parameters", "optimizer state", "buffers")

# How far a float32 result that sums many terms may move when the terms are added in another
# order (another CPU's kernels, a sharded reduction), relative to the largest element of the
# tensor: up to about K·eps·scale for K terms; our example models sum at most a few thousand
# terms per element (eps = 1.2e-7). A real bug is off by the order of the scale itself.
REDUCTION_RTOL = 1e-5
_ROUNDING = 4 * torch.finfo(torch.float32).eps  # a few roundings of one elementwise formula


@dataclass(frozen=True)
class WorstError:
    """The largest absolute error among the tensors of one kind, and where it is."""

    kind: str
    max_abs_error: float
    at: str  # the tensor holding that error: a parameter name, "optim.step", "output 0"
    tensors: int  # how many tensors of this kind were compared
    tolerance_used: float  # max over elements of |error| / what rounding allows (see
    # allowed_errors): at most 1 when the difference is rounding, not a bug

    def line(self) -> str:
        where = "" if self.kind == "loss" else f" at {self.at}"
        return (f"{self.kind}: max abs error {self.max_abs_error:.1e}{where} "
                f"({self.tensors} tensor{'s' * (self.tensors != 1)}, "
                f"{self.tolerance_used:.2g} of the rounding tolerance)")


@dataclass(frozen=True)
class EagerCheck:
    """Every output of one run compared with eager PyTorch: the worst error of each kind."""

    errors: dict[str, WorstError]  # by kind, in KINDS order; kinds the graph lacks are absent

    @property
    def max_abs_error(self) -> float:
        return max((e.max_abs_error for e in self.errors.values()), default=0.0)

    @property
    def within_tolerance(self) -> bool:
        """Whether every difference is one that float rounding explains."""
        return all(e.tolerance_used <= 1.0 for e in self.errors.values())

    def lines(self) -> list[str]:
        return [e.line() for e in self.errors.values()]

    def as_dict(self) -> dict[str, dict]:
        return {kind: {"max_abs_error": e.max_abs_error, "at": e.at, "tensors": e.tensors,
                       "tolerance_used": e.tolerance_used}
                for kind, e in self.errors.items()}


def eager_results(spec: ModelSpec, train: bool, optimizer: Optimizer | None = None
                  ) -> dict[tuple[str, str], torch.Tensor]:
    """What eager PyTorch computes for `spec`, by (kind, name): the outputs for inference; for
    a training step the loss, each gradient, and after `optimizer`'s torch.optim step the
    parameters, the optimizer state (named as the graph names it) and the buffers.

    Runs on a copy of the module, which is left as it was.
    """
    module = copy.deepcopy(spec.module)
    if not train:
        with torch.no_grad():
            out = module(*spec.inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return {("outputs", f"output {i}"): t for i, t in enumerate(outs)}
    if spec.loss_fn is None:
        raise GraphparError(f"{spec.name}: a training step needs a loss to compare with eager")
    module.zero_grad(set_to_none=True)
    loss = spec.loss_fn(module(*spec.inputs), *spec.targets)
    loss.backward()
    return {("loss", "loss"): loss.detach(), **step_results(module, optimizer)}


def step_results(module: torch.nn.Module, optimizer: Optimizer | None = None
                 ) -> dict[tuple[str, str], torch.Tensor]:
    """The gradients `module`'s parameters hold, then, after `optimizer`'s torch.optim step
    from zero state, its parameters, optimizer state and buffers, keyed as `eager_results`
    keys them. Steps `module` itself."""
    params = dict(module.named_parameters())
    # a tied weight under each of its names: a graph reports it under the one it kept
    names = dict(module.named_parameters(remove_duplicate=False))
    reference = optimizer.reference(params.values()) if optimizer is not None else None
    expected = {("gradients", name): p.grad.detach().clone()
                for name, p in names.items() if p.grad is not None}
    if reference is not None:
        reference.step()
        for name, p in names.items():
            for key, value in reference.state.get(p, {}).items():
                state_name = STEP if key == "step" else f"{name}.{key}"
                expected["optimizer state", state_name] = torch.as_tensor(value)
    expected.update({("parameters", name): p.detach() for name, p in names.items()})
    expected.update({("buffers", name): b for name, b in module.named_buffers()})
    # a tied parameter (one tensor, two names) is stepped once above; a graph may name it by
    # either name (capture keeps one of them), so both are keyed
    canonical = {id(p): name for name, p in params.items()}
    for alias, p in module.named_parameters(remove_duplicate=False):
        name = canonical[id(p)]
        if alias != name:
            for (kind, key), t in list(expected.items()):
                if kind in ("gradients", "parameters") and key == name:
                    expected[kind, alias] = t
                elif kind == "optimizer state" and key.startswith(name + "."):
                    expected[kind, alias + key[len(name):]] = t
    return expected


def output_key(out: Output, index: int, params: set[str], buffers: set[str]) -> tuple[str, str]:
    """(kind, name) of one graph output, as `eager_results` keys it."""
    if out.role is OutputRole.OUTPUT:
        return "outputs", f"output {index}"
    if out.role is OutputRole.LOSS:
        return "loss", "loss"
    if out.role is OutputRole.GRAD:
        return "gradients", out.target
    if out.target in params:
        return "parameters", out.target
    if out.target in buffers:
        return "buffers", out.target
    return "optimizer state", out.target


def allowed_errors(expected: dict[tuple[str, str], torch.Tensor], initial: dict[str, torch.Tensor],
                   optimizer: Optimizer | None = None) -> dict[tuple[str, str], torch.Tensor]:
    """Per element, how far each of `expected` (from `eager_results`) may be from another
    float32 computation of the same maths, one step from `initial` parameters and zero
    optimizer state, when only the order of additions differs.

    Reductions (outputs, loss, gradients, batch statistics) get REDUCTION_RTOL of their
    tensor's scale. An optimizer step is elementwise, so its tolerance is the gradient's, δ,
    carried through the step's formula:

    - SGD: p - lr·(g + wd·p) moves by lr·δ; the momentum buffer (g + wd·p on a first step)
      by δ.
    - Adam, first step: m = (1-β1)·g and v = (1-β2)·g² are off by (1-β1)·δ and
      (1-β2)·(2|g|δ + δ²); after bias correction the update is lr·g/(|g| + eps), whose slope
      lr·eps/(|g| + eps)² is 1/eps·lr near g = 0: a gradient that is itself at rounding level
      (|g| ≲ δ) may move its parameter anywhere in ±lr, so the bound there is 2·lr, and it
      shrinks as eps·δ/|g|² where the gradient is well above its rounding. The graph computes
      the bias corrections 1 - β^t in float32 (as torch.optim's capturable Adam does; the
      default one uses float64), which cancels: each is off by about eps32/(1 - β^t)
      relative, 5e-5 for β2 = 0.999, so every update may be off by that part of lr too.

    Every result also gets a few float32 roundings of its own magnitude.
    """
    def scale(t: torch.Tensor) -> torch.Tensor:
        return t.detach().double().abs().amax() if t.numel() else torch.zeros((), dtype=t.dtype)

    grad_tol = {name: REDUCTION_RTOL * scale(g) for (kind, name), g in expected.items()
                if kind == "gradients"}
    allowed = {}
    for (kind, name), want in expected.items():
        magnitude = want.detach().double().abs()
        rounding = _ROUNDING * magnitude
        if kind in ("outputs", "loss", "gradients", "buffers"):
            allowed[kind, name] = REDUCTION_RTOL * scale(want) + rounding
        elif kind == "parameters":
            allowed[kind, name] = _step_tolerance(optimizer, initial[name].detach().double(),
                                                  expected.get(("gradients", name)),
                                                  grad_tol.get(name), rounding)
        else:  # optimizer state: name is "<param>.<slot>" or the shared step counter
            param, _, slot = name.rpartition(".")
            delta = grad_tol.get(param)
            if delta is None or slot not in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                allowed[kind, name] = rounding  # the step counter: exact
            elif slot == "exp_avg_sq":
                g = expected["gradients", param].double().abs()
                allowed[kind, name] = (1 - optimizer.beta2) * (2 * g * delta + delta**2) + rounding
            elif slot == "exp_avg":
                allowed[kind, name] = (1 - optimizer.beta1) * delta + rounding
            else:
                allowed[kind, name] = delta + rounding
    return allowed


def _step_tolerance(optimizer: Optimizer | None, param: torch.Tensor, grad: torch.Tensor | None,
                    delta: torch.Tensor | None, rounding: torch.Tensor) -> torch.Tensor:
    if optimizer is None or grad is None:  # not updated (no optimizer, or no gradient)
        return rounding
    lr = optimizer.lr
    if isinstance(optimizer, Adam):
        g = (grad.double() + optimizer.weight_decay * param).abs()
        slope_bound = delta * optimizer.eps / ((g - delta).clamp(min=0) + optimizer.eps) ** 2
        bias_corrections = _ROUNDING * (1 / (1 - optimizer.beta1) + 0.5 / (1 - optimizer.beta2))
        return lr * (slope_bound.clamp(max=2.0) + bias_corrections) + rounding
    return lr * delta + rounding + _ROUNDING * lr * grad.double().abs()


def check_against_eager(outputs: Sequence[Output], tensors: Sequence[torch.Tensor],
                        spec: ModelSpec, optimizer: Optimizer | None = None,
                        expected: dict[tuple[str, str], torch.Tensor] | None = None
                        ) -> EagerCheck:
    """Compare a run's `tensors` (one per graph output in `outputs`) with eager PyTorch plus
    the real torch.optim step of `optimizer` (one step from the module's own parameters and
    zero optimizer state); a training step is a graph with a loss output. `expected`: the
    eager results to compare with, when not `eager_results(spec, ...)` (a pipeline's
    microbatch-by-microbatch step)."""
    train = any(o.role is OutputRole.LOSS for o in outputs)
    if expected is None:
        expected = eager_results(spec, train, optimizer)
    allowed = allowed_errors(expected,
                             dict(spec.module.named_parameters(remove_duplicate=False)),
                             optimizer)
    params = {name for kind, name in expected if kind == "parameters"}
    buffers = {name for kind, name in expected if kind == "buffers"}
    worst: dict[str, tuple[float, str]] = {}
    used: dict[str, float] = {}
    counts: dict[str, int] = {}
    user_outputs = 0
    for out, got in zip(outputs, tensors, strict=True):
        key = output_key(out, user_outputs, params, buffers)
        user_outputs += out.role is OutputRole.OUTPUT
        if key not in expected:
            raise GraphparError(f"graph output {out.role.value} {out.target or ''} has no eager "
                                f"counterpart ({key[0]} {key[1]!r})")
        want = expected[key]
        if tuple(got.shape) != tuple(want.shape):
            raise GraphparError(f"{key[0]} {key[1]}: shape {tuple(got.shape)}, eager has "
                                f"{tuple(want.shape)}")
        diff = (got.double() - want.double()).abs()
        error = float(diff.max()) if diff.numel() else 0.0
        ratio = diff / allowed[key].clamp(min=torch.finfo(torch.float64).tiny)
        ratio = float(ratio.max()) if ratio.numel() else 0.0
        kind = key[0]
        counts[kind] = counts.get(kind, 0) + 1
        if kind not in worst or error > worst[kind][0] or error != error:  # NaN is worst
            worst[kind] = (error, key[1])
        used[kind] = max(used.get(kind, 0.0), ratio) if ratio == ratio else float("nan")
    return EagerCheck({kind: WorstError(kind, *worst[kind], counts[kind], used[kind])
                       for kind in KINDS if kind in worst})
