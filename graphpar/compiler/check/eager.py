"""The certificate: a plan's steps against eager PyTorch and torch.optim, each element against
the rounding error its own computation allows, with one verdict.

    reference = eager_reference(spec, train=True, optimizer=Adam(), steps=3)
    check = compare(graph.outputs, [outputs_of_step_1, ...], reference)
    print(check.verdict())          # "equal to eager ... within rounding" or where it failed
    check.within_tolerance          # what the CLI turns into its exit status

The reference is eager PyTorch run in float64 (`rounding.Float64`): the module,
its loss and backward, and the real torch.optim step, `steps` times with the optimizer's state
carried, on the same example batch each step. Its `SAMPLES` companions run the same code with
float32-sized rounding errors drawn at random wherever float32 would round
(`rounding.Rounding`). At each element, the spread σ of the companions around
the float64 result is how far float32 rounding moves that element in this computation. The
plan computes in float32, in its own order; an element passes when

    |plan - float64| <= SIGMAS·max(σ, FLOOR·rms(σ over its tensor)) + u·|float64|

The first term is rounding in the computation: SIGMAS = 12 standard deviations. The elements of
the suite's models stay within about 5σ; the margin is for other CPUs' kernels and summation
orders. The floor keeps an element whose few samples happened to agree from getting a tiny
bound. For Adam's updates σ also counts what the companions cannot draw (`adam_copies`): a plan
may compute a gradient twice, and the copies' rounding survives in m / √v. The second term is
the rounding of the float32 result itself (u = 2**-24). A bug is not rounding: an error of 1e-4
of a value in one op of the plan moves what follows by hundreds of σ.

`tolerance_used` is the largest |error| / bound over a kind's elements: at most 1 is rounding.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graphpar.capture.optim import STEP, Adam, Optimizer
from graphpar.compiler.check.rounding import UNIT, float64_run, to_float64
from graphpar.errors import GraphparError
from graphpar.ir.graph import Output, OutputRole

if TYPE_CHECKING:
    from graphpar.compiler.driver import ModelSpec

__all__ = ["FLOOR", "KINDS", "SAMPLES", "SIGMAS", "EagerCheck", "Reference", "WorstError",
           "adam_copies", "compare", "eager_reference", "eager_steps", "output_key"]

# What a graph output can be, in report order: inference outputs, then a training step's loss,
# gradients, updated parameters, new optimizer state and mutated buffers (batch-norm statistics).
KINDS = ("outputs", "loss", "gradients", "parameters", "optimizer state", "buffers")

SAMPLES = 8  # rounding companions of the float64 reference
SIGMAS = 12.0  # the bound, in standard deviations of the rounding spread
FLOOR = 0.1  # an element's spread is at least this part of its tensor's RMS spread

Key = tuple[str, str]  # (kind, name): ("gradients", "blocks.0.attn.qkv.weight")
Results = dict[Key, torch.Tensor]


@dataclass
class Reference:
    """Eager PyTorch's results in float64, step by step, with the rounding spread of each."""

    values: list[Results]  # per step, (kind, name) -> float64 result
    spreads: list[Results]  # per step, the RMS distance of the rounding companions
    # per step, spreads the companions cannot show, added to theirs (`adam_copies`)
    extra: list[Results] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.values)

    def bound(self, step: int, key: Key) -> torch.Tensor:
        """Per element, the largest difference rounding explains (module docstring)."""
        value, spread = self.values[step][key], self.spreads[step][key]
        if not value.is_floating_point():
            return torch.zeros(value.shape, dtype=torch.float64)
        spread = spread.double()
        floor = FLOOR * spread.square().mean().sqrt() if spread.numel() else 0.0
        spread = torch.maximum(spread, torch.as_tensor(floor))
        extra = self.extra[step].get(key) if step < len(self.extra) else None
        if extra is not None:
            spread = (spread.square() + extra.square()).sqrt()
        return SIGMAS * spread + UNIT * value.abs()


def eager_reference(spec: ModelSpec, train: bool, optimizer: Optimizer | None = None,
                    steps: int = 1, microbatches: int = 1, samples: int = SAMPLES) -> Reference:
    """What eager PyTorch computes for `spec` over `steps` steps, in float64, and how far
    float32 rounding moves each result (`samples` rounding companions); see `eager_steps`."""
    def run(seed: int | None) -> list[Results]:
        return eager_steps(spec, train, optimizer, steps, microbatches, seed)
    reference = reference_of(run, samples)
    if isinstance(optimizer, Adam):
        reference.extra = adam_copies(reference, optimizer)
    return reference


def adam_copies(reference: Reference, adam: Adam) -> list[Results]:
    """Per step and parameter, how far Adam's update moves when its two moments see copies of
    the gradient rounded apart: a plan may compute a gradient twice (reduced on two paths), and
    m / √v, in which the gradient cancels in exact arithmetic, then keeps the copies'
    difference, which the companions (one computation of each value) never draw. The update
    lr·m̂/(√v̂ + eps) moves by lr·(1-β1)/(1-β1^t)·δ/(√v̂ + eps) for a gradient off by δ; δ is
    the gradient's own rounding spread."""
    extra: list[Results] = []
    for t, (values, spreads) in enumerate(zip(reference.values, reference.spreads), start=1):
        step: Results = {}
        for kind, name in values:
            grad = spreads.get(("gradients", name))
            v = values.get(("optimizer state", f"{name}.exp_avg_sq"))
            if kind != "parameters" or grad is None or v is None:
                continue
            v_hat = v.double() / (1 - adam.beta2 ** t)
            step[kind, name] = (adam.lr * (1 - adam.beta1) / (1 - adam.beta1 ** t)
                                * grad.double() / (v_hat.sqrt() + adam.eps))
        extra.append(step)
    return extra


def reference_of(run: Callable[[int | None], list[Results]], samples: int = SAMPLES
                 ) -> Reference:
    """The Reference of `run(seed)`: float64 results per step (seed None) and the RMS spread
    of `samples` rounding companions (seeds 0 .. samples-1) around them."""
    values = run(None)
    squares = [{k: torch.zeros(v.shape, dtype=torch.float64) for k, v in step.items()}
               for step in values]
    for seed in range(samples):
        for step, (exact, sample) in enumerate(zip(values, run(seed))):
            for key, value in exact.items():
                if value.is_floating_point():
                    deviation = torch.nan_to_num(sample[key].double() - value.double(),
                                                 0.0, 0.0, 0.0)
                    squares[step][key] += deviation.square()
    spreads = [{k: (s / max(samples, 1)).sqrt() for k, s in step.items()} for step in squares]
    return Reference(values, spreads)


def eager_steps(spec: ModelSpec, train: bool, optimizer: Optimizer | None = None,
                steps: int = 1, microbatches: int = 1, seed: int | None = None
                ) -> list[Results]:
    """Eager PyTorch on a float64 copy of `spec`'s module, by (kind, name) per step: the
    outputs for inference; for training the loss, each gradient, and after `optimizer`'s
    torch.optim step the parameters, the optimizer state (named as the graph names it) and
    the buffers, `steps` times from the module's own state and zero optimizer state, on the
    example batch each time. `microbatches` > 1: each step accumulates the gradients of the
    batch's equal parts (each part's loss / microbatches), as a pipeline does; with batch norm
    each part normalizes by its own statistics. `seed`: modelled rounding (`Rounding`).

    The module itself is left as it was."""
    module = copy.deepcopy(spec.real_module()).double()
    inputs = tuple(to_float64(t) for t in spec.inputs)
    targets = tuple(to_float64(t) for t in spec.targets)
    with float64_run(seed):
        if not train:
            with torch.no_grad():
                out = module(*inputs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            return [{("outputs", f"output {i}"): t for i, t in enumerate(outs)}]
        if spec.loss_fn is None:
            raise GraphparError(f"{spec.name}: a training step needs a loss to compare with "
                                "eager")
        params = dict(module.named_parameters())
        reference = optimizer.reference(params.values()) if optimizer is not None else None
        results = []
        for _ in range(steps):
            module.zero_grad(set_to_none=True)
            losses = []
            for part_inputs, part_targets in _parts(inputs, targets, microbatches):
                loss = spec.loss_fn(module(*part_inputs), *part_targets)
                (loss / microbatches if microbatches > 1 else loss).backward()
                losses.append(loss.detach())
            loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
            results.append({("loss", "loss"): loss.clone(), **_stepped(module, reference)})
        return results


def _parts(inputs, targets, microbatches: int):
    if microbatches == 1:
        return [(inputs, targets)]
    split = [t.chunk(microbatches) for t in (*inputs, *targets)]
    return [(tuple(s[i] for s in split[:len(inputs)]), tuple(s[i] for s in split[len(inputs):]))
            for i in range(microbatches)]


def _stepped(module: torch.nn.Module, reference) -> Results:
    """The gradients `module`'s parameters hold, then, after the torch.optim `reference`'s
    step, its parameters, optimizer state and buffers (copies), a tied weight under each of
    its names (a graph reports it under the one capture kept)."""
    params = dict(module.named_parameters())
    names = dict(module.named_parameters(remove_duplicate=False))
    out: Results = {("gradients", name): p.grad.detach().clone()
                    for name, p in names.items() if p.grad is not None}
    if reference is not None:
        reference.step()
        for name, p in names.items():
            for key, value in reference.state.get(p, {}).items():
                state_name = STEP if key == "step" else f"{name}.{key}"
                out["optimizer state", state_name] = torch.as_tensor(value).detach().clone()
    out.update({("parameters", name): p.detach().clone() for name, p in names.items()})
    out.update({("buffers", name): b.detach().clone() for name, b in module.named_buffers()})
    canonical = {id(p): name for name, p in params.items()}
    for alias, p in names.items():
        name = canonical[id(p)]
        if alias == name:
            continue
        for (kind, key), t in list(out.items()):
            if kind in ("gradients", "parameters") and key == name:
                out[kind, alias] = t
            elif kind == "optimizer state" and key.startswith(name + "."):
                out[kind, alias + key[len(name):]] = t
    return out


def output_key(out: Output, index: int, params: set[str], buffers: set[str]) -> Key:
    """(kind, name) of one graph output, as `eager_steps` keys it."""
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


@dataclass(frozen=True)
class WorstError:
    """The worst element among the tensors of one kind: where it is, its error and its bound."""

    kind: str
    max_abs_error: float  # the largest absolute error of the kind
    at: str  # the tensor holding the element with the largest error / bound
    tensors: int  # how many tensors of this kind were compared (per step)
    tolerance_used: float  # max over elements of |error| / bound: at most 1 is rounding
    step: int = 1  # the step (from 1) of that element
    index: tuple[int, ...] = ()  # its position in its tensor
    error: float = 0.0  # its error
    bound: float = 0.0  # its bound

    def line(self) -> str:
        where = "" if self.kind == "loss" else f" at {self.at}"
        return (f"{self.kind}: max abs error {self.max_abs_error:.1e}{where} "
                f"({self.tensors} tensor{'s' * (self.tensors != 1)}, "
                f"{self.tolerance_used:.2g} of the rounding tolerance)")

    def element(self) -> str:
        """The worst element, its error and bound, in words."""
        where = self.at + (f"[{', '.join(map(str, self.index))}]" if self.index else "")
        return (f"{self.kind} {where} at step {self.step}: error {self.error:.2e}, bound "
                f"{self.bound:.2e} ({self.tolerance_used:.3g}x)")


@dataclass
class EagerCheck:
    """Every output of every step compared with eager PyTorch: the worst of each kind."""

    errors: dict[str, WorstError]  # by kind, worst over the steps, in KINDS order
    by_step: list[dict[str, WorstError]] = field(default_factory=list)
    where: str | None = None  # for a failure, where the plan first differs (`localize`)

    @property
    def steps(self) -> int:
        return len(self.by_step)

    @property
    def max_abs_error(self) -> float:
        return max((e.max_abs_error for e in self.errors.values()), default=0.0)

    @property
    def tolerance_used(self) -> float:
        return max((e.tolerance_used for e in self.errors.values()), default=0.0)

    @property
    def within_tolerance(self) -> bool:
        """Whether every difference is one that float32 rounding explains (NaN is not)."""
        return all(e.tolerance_used <= 1.0 for e in self.errors.values())

    @property
    def worst(self) -> WorstError | None:
        """The element furthest beyond (or nearest to) its bound."""
        return max(self.errors.values(), key=lambda e: _key(e.tolerance_used), default=None)

    def lines(self) -> list[str]:
        return [e.line() for e in self.errors.values()]

    def verdict(self) -> str:
        """One line: certified, or failed at which element (and where the plan broke)."""
        steps = f"{self.steps} step{'s' * (self.steps != 1)}"
        worst = self.worst
        if worst is None:
            return "verdict    nothing compared"
        if self.within_tolerance:
            return (f"verdict    PASS: {steps} equal to eager PyTorch (float64) within float32 "
                    f"rounding; closest: {worst.kind} {worst.at}, "
                    f"{worst.tolerance_used:.2g} of its bound")
        line = f"verdict    FAIL: {steps}, {worst.element()}"
        return line + (f"; the plan first differs at {self.where}" if self.where else "")

    def as_dict(self) -> dict[str, dict]:
        return {kind: _as_dict(e) for kind, e in self.errors.items()}

    def report(self) -> dict:
        """What report.json keeps of the check."""
        worst = self.worst
        return {"within_tolerance": self.within_tolerance, "checked_steps": self.steps,
                "tolerance_used": self.tolerance_used, "max_abs_error": self.max_abs_error,
                "errors": self.as_dict(),
                "by_step": [{k: _as_dict(e) for k, e in s.items()} for s in self.by_step],
                "worst": None if worst is None else _as_dict(worst),
                "first_difference": self.where, "verdict": self.verdict()}


def _as_dict(e: WorstError) -> dict:
    return {"max_abs_error": e.max_abs_error, "at": e.at, "tensors": e.tensors,
            "tolerance_used": e.tolerance_used, "step": e.step, "index": list(e.index),
            "error": e.error, "bound": e.bound}


def _key(x: float) -> float:
    return math.inf if x != x else x  # NaN is the worst


def compare(outputs: Sequence[Output], steps: Sequence[Sequence[torch.Tensor]],
            reference: Reference) -> EagerCheck:
    """Compare a run's tensors, per step one per graph output in `outputs`, with `reference`
    (whose steps they must match in number)."""
    if len(steps) != reference.steps:
        raise GraphparError(f"{len(steps)} steps ran, the reference has {reference.steps}")
    params = {name for kind, name in reference.values[0] if kind == "parameters"}
    buffers = {name for kind, name in reference.values[0] if kind == "buffers"}
    by_step = [_compare_step(outputs, tensors, reference, s, params, buffers)
               for s, tensors in enumerate(steps)]
    errors = {}
    for kind in KINDS:
        found = [s[kind] for s in by_step if kind in s]
        if found:
            worst = max(found, key=lambda e: _key(e.tolerance_used))
            largest = max((e.max_abs_error for e in found), key=_key)
            errors[kind] = WorstError(kind, largest, worst.at, worst.tensors,
                                      worst.tolerance_used, worst.step, worst.index,
                                      worst.error, worst.bound)
    return EagerCheck(errors, by_step)


def _compare_step(outputs, tensors, reference: Reference, step: int, params, buffers
                  ) -> dict[str, WorstError]:
    expected = reference.values[step]
    worst: dict[str, dict] = {}
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
        error = _difference(got, want)
        bound = reference.bound(step, key)
        used = error / bound.clamp(min=torch.finfo(torch.float64).tiny)
        used = torch.where(error == 0, 0.0, used)
        kind = key[0]
        w = worst.setdefault(kind, {"largest": 0.0, "used": -1.0, "tensors": 0})
        w["tensors"] += 1
        if error.numel() == 0:
            continue
        largest = float(error.max()) if not error.isnan().any() else math.nan
        w["largest"] = max(w["largest"], largest, key=_key)
        flat = torch.nan_to_num(used.flatten(), nan=math.inf)
        i = int(flat.argmax())
        tolerance_used = float(used.flatten()[i])
        if _key(tolerance_used) > _key(w["used"]):
            index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), used.shape))
            w.update(used=tolerance_used, at=key[1], index=index,
                     error=float(error.flatten()[i]), bound=float(bound.flatten()[i]))
    return {kind: WorstError(kind, w["largest"], w.get("at", ""), w["tensors"],
                             max(w["used"], 0.0) if w["used"] == w["used"] else math.nan,
                             step + 1, w.get("index", ()), w.get("error", 0.0),
                             w.get("bound", 0.0))
            for kind, w in ((k, worst[k]) for k in KINDS if k in worst)}


def _difference(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in float64; equal non-finite values (both NaN, the same infinity) differ
    by 0, a NaN against a number by NaN."""
    got, want = got.detach().double(), want.detach().double()
    error = (got - want).abs()
    same = (got == want) | (got.isnan() & want.isnan())
    return torch.where(same, 0.0, error)
