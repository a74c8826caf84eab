"""Capture: a torch.nn.Module and example inputs become an IR graph (inference or training step)."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import traceback
import warnings
from collections.abc import Callable, Sequence

import torch
from torch._decomp import core_aten_decompositions

from graphpar.backends import reference
from graphpar.capture.aten_table import PRESERVED
from graphpar.capture.fake import abstract_state, fake_tensors, has_meta_tensors
from graphpar.capture.fx_import import _tied_aliases, import_exported, short_location
from graphpar.capture.optim import Optimizer, append_optimizer
from graphpar.capture.repeat import capture_repeated
from graphpar.errors import CaptureError, GraphparError
from graphpar.ir.graph import Graph, OutputRole, Role


class Captured:
    """A captured graph with the tensors its non-user inputs start from.

    A capture of a module built on the meta device holds meta tensors (shapes, no data) as
    its state; `realize`, when given, makes the real ones the first time the state is read
    (to run the graph), and planning never reads it."""

    def __init__(self, graph: Graph, state: dict[str, torch.Tensor] | None = None,
                 realize: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
        self.graph = graph
        self._state = dict(state or {})
        self.realize = realize

    @property
    def abstract(self) -> bool:
        """Whether the state is still shapes only (meta tensors)."""
        return any(t.is_meta for t in self._state.values())

    @property
    def state(self) -> dict[str, torch.Tensor]:
        if self.realize is not None and self.abstract:
            self._state = self.realize()
            self.realize = None
        return self._state

    @state.setter
    def state(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    @property
    def user_inputs(self) -> list[str]:
        return [v.name for v in self.graph.inputs_with_role(Role.INPUT)]

    def bind(self, *args: torch.Tensor) -> dict[str, torch.Tensor]:
        """All graph inputs by name: the user's tensors in call order, then the state."""
        names = self.user_inputs
        if len(args) != len(names):
            raise GraphparError(f"graph @{self.graph.name} takes {len(names)} user inputs "
                                f"({', '.join(names)}), got {len(args)}")
        return {**self.state, **dict(zip(names, args))}

    def run(self, *args: torch.Tensor) -> list[torch.Tensor]:
        """Execute on the CPU reference executor."""
        return reference.run(self.graph, self.bind(*args))

    def apply_updates(self, outputs: Sequence[torch.Tensor]) -> None:
        """Write `update` outputs of a run back into the state, ready for the next step."""
        for out, tensor in zip(self.graph.outputs, outputs):
            if out.role is OutputRole.UPDATE:
                self.state[out.target] = tensor


def _abstract_state(graph: Graph, traced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Meta tensors for the graph's non-user inputs: the traced ones where the trace had them,
    new ones for the inputs of repeated layers."""
    return {v.name: traced[v.name] if v.name in traced
            else torch.empty(v.type.shape, dtype=v.type.dtype, device="meta")
            for v in graph.inputs if v.role is not Role.INPUT}


def _decompositions(table: dict) -> dict:
    for op in PRESERVED:
        table.pop(op, None)
    return table


@contextlib.contextmanager
def quiet():
    """torch's own notices and logs during export are not the user's business: a failure
    becomes one CaptureError that names the user's line."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        logger.setLevel(level)


def _export(module: torch.nn.Module, args: tuple, what: str):
    try:
        with quiet():
            return torch.export.export(module, args, strict=False)
    except GraphparError:
        raise
    except Exception as exc:
        raise CaptureError(_capture_message(exc, what)) from None


def _capture_message(exc: Exception, what: str) -> str:
    """The torch error, shortened, with the innermost user source line it came from."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(os.path.dirname(torch.__file__))
              and "graphpar" + os.sep + "capture" not in f.filename and "<" not in f.filename]
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    message = f"cannot capture {what}: {type(exc).__name__}: {first_line}"
    if frames:
        f = frames[-1]
        message += f"\n  at {short_location(f.filename, f.lineno)}: {(f.line or '').strip()}"
    return message + ("\n  graphpar captures with torch.export: the model must trace with static "
                      "shapes and no data-dependent Python control flow.")


def capture_inference(module: torch.nn.Module, args: Sequence[torch.Tensor],
                      name: str = "main", repeat_layers: bool = True) -> Captured:
    """The forward pass of `module` on `args` as one graph with global shapes.

    Parameters and buffers become graph inputs with their roles; the module is captured as it
    is (call `.eval()` first for inference behaviour of dropout and batch norm).

    A module on the meta device is traced with fake tensors; with `repeat_layers`, a deep
    stack of identical layers is traced with a few of them and its IR repeated
    (graphpar.capture.repeat).
    """
    if has_meta_tensors(module, args):
        with fake_tensors(module, args) as fake_args:
            traced: list[Captured] = []

            def trace() -> Graph:
                traced.append(capture_inference(module, fake_args, name))
                return traced[-1].graph

            graph = capture_repeated(module, trace) if repeat_layers else None
            if graph is None:
                graph = trace()
        return Captured(graph, _abstract_state(graph, abstract_state(traced[-1].state)))
    ep = _export(module, tuple(args), f"{type(module).__name__}.forward")
    try:
        with quiet():
            ep = ep.run_decompositions(_decompositions(torch.export.default_decompositions()))
    except Exception as exc:
        raise CaptureError(_capture_message(exc, "the exported graph (decomposition)")) from None
    graph, state = import_exported(ep, name)
    return Captured(graph, state)


class _TrainingStep(torch.nn.Module):
    """forward(*inputs, *targets) -> loss: the module and its loss as one exportable module."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable, num_inputs: int):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs

    def forward(self, *args):
        out = self.module(*args[:self.num_inputs])
        return (self.loss_fn(out, *args[self.num_inputs:]),)


def _drop_tied_aliases(ep):
    """The program without the unused placeholders of tied weights (see `_tied_aliases`), and
    the (alias, carrier) target pairs: autograd's joint graph wants a gradient for every
    parameter placeholder."""
    from torch.export.experimental import _copy_graph_module_and_signature

    specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs}
    aliases = _tied_aliases(ep, specs)
    if not aliases:
        return ep, ()
    tied = tuple(sorted((specs[a].target.removeprefix("module."),
                         specs[b].target.removeprefix("module.")) for a, b in aliases.items()))
    with quiet():
        gm, signature = _copy_graph_module_and_signature(ep)
        for node in list(gm.graph.nodes):
            if node.op == "placeholder" and node.name in aliases:
                gm.graph.erase_node(node)
        signature.input_specs = [s for s in signature.input_specs if s.arg.name not in aliases]
        gm.recompile()
        return ep._update(gm, signature), tied


def _params_not_reaching_loss(ep) -> set[str]:
    """Parameters (by target name) that the loss does not depend on. An op that writes into a
    tensor in place (`key[..., :n] = x`, a `copy_` into a view, as DeepSeek-V3 assembles its
    keys) feeds what reads that tensor later, which the graph's edges do not show: its operands
    count as needed."""
    output = next(n for n in ep.graph.nodes if n.op == "output")
    needed, stack = set(), [output, *(n for n in ep.graph.nodes if _writes_in_place(n))]
    while stack:
        node = stack.pop()
        for dep in node.all_input_nodes:
            if dep not in needed:
                needed.add(dep)
                stack.append(dep)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    params = [s for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER"]
    used = [ep.state_dict[s.target] for s in params if placeholders[s.arg.name] in needed]
    # A tied weight is exported once per name; the unused name is an alias, not a frozen param.
    return {s.target for s in params if placeholders[s.arg.name] not in needed
            and not any(ep.state_dict[s.target] is t for t in used)}


def _writes_in_place(node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write
                                      for a in schema.arguments)


def infer_modules(graph: Graph) -> None:
    """Module paths for nodes the joint graph lost them on: a node belongs with the parameter
    it reads, else with its most recently computed operand. Viz groups and the sharding ILP's
    layer tying read these."""
    owner: dict = {}
    position: dict = {}
    for v in graph.inputs:
        if v.role in (Role.PARAM, Role.BUFFER) and "." in v.name:
            owner[v] = v.name.rsplit(".", 1)[0]
            position[v] = len(graph.nodes)  # a parameter read decides over anything else
    for i, node in enumerate(graph.nodes):
        if node.module is None:
            known = [v for v in node.input_values if v in owner]
            if known:
                node.module = owner[max(known, key=lambda v: position.get(v, -1))]
        if node.module is not None:
            for out in node.outputs:
                owner[out] = node.module
                position[out] = i


def _argument_names(module: torch.nn.Module, num_inputs: int, num_targets: int) -> list[str]:
    """The forward's own parameter names for the inputs, then `target`, `target_1`, ..."""
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = params[:num_inputs] + [f"input_{i}" for i in range(len(params), num_inputs)]
    names += ["target" if i == 0 else f"target_{i}" for i in range(num_targets)]
    return names


def capture_training(module: torch.nn.Module, args: Sequence[torch.Tensor],
                     loss_fn: Callable, targets: Sequence[torch.Tensor] = (),
                     optimizer: Optimizer | None = None, name: str = "train_step",
                     keep_grads: bool = False, repeat_layers: bool = True) -> Captured:
    """One whole training step as one graph: forward, loss, backward and optimizer update.

    Outputs: the loss, then `update` outputs for each parameter and optimizer-state tensor
    (and buffers the forward mutates, e.g. batch-norm statistics). Without an optimizer the
    graph returns the gradients instead (`grad` outputs).

    A module on the meta device is traced with fake tensors: the state is then meta tensors
    (optimizer state included), and nothing the size of the weights is allocated. With
    `repeat_layers`, a deep stack of identical layers is traced with a few of them and its IR
    repeated (graphpar.capture.repeat).
    """
    if has_meta_tensors(module, (*args, *targets)):
        with fake_tensors(module, (*args, *targets)) as fake_args:
            def trace() -> Graph:
                return capture_training(module, fake_args[:len(args)], loss_fn,
                                        fake_args[len(args):], None, name, keep_grads).graph

            graph = capture_repeated(module, trace) if repeat_layers else None
            if graph is None:
                graph = trace()
        state = {v.name: torch.empty(v.type.shape, dtype=v.type.dtype, device="meta")
                 for v in graph.inputs if v.role is not Role.INPUT}
        if optimizer is not None:
            append_optimizer(graph, optimizer, state, keep_grads=keep_grads)
        return Captured(graph, state)
    step = _TrainingStep(module, loss_fn, len(args))
    what = f"{type(module).__name__} training step"
    ep, tied = _drop_tied_aliases(_export(step, tuple(args) + tuple(targets), what))
    unused = _params_not_reaching_loss(ep)
    if unused:  # they get no gradient, as in eager; autograd's joint graph needs them frozen
        frozen = [p for n, p in step.named_parameters() if n in unused and p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            ep, _ = _drop_tied_aliases(_export(step, tuple(args) + tuple(targets), what))
        finally:
            for p in frozen:
                p.requires_grad_(True)
    from torch.export.experimental import (
        _copy_graph_module_and_signature,
        _decompose_exported_program,
        _remove_detach_pass,
    )

    try:
        with quiet():
            ep = _decompose_exported_program(
                ep, cia_to_decomp={},
                python_decomp_table=_decompositions(core_aten_decompositions()),
                joint_loss_index=0, decompose_custom_triton_ops=False)
            gm, signature = _copy_graph_module_and_signature(ep)
            _remove_detach_pass(gm, signature)
            ep = ep._update(gm, signature)
    except Exception as exc:
        raise CaptureError(_capture_message(exc, "the backward pass")) from None
    # The wrapper adds a "module." prefix; names stay those of the user's module.
    names = {spec.target: spec.target.removeprefix("module.")
             for spec in ep.graph_signature.input_specs if spec.target}
    user_specs = [spec for spec in ep.graph_signature.input_specs if spec.target is None]
    for spec, arg_name in zip(user_specs, _argument_names(module, len(args), len(targets))):
        names[spec.arg.name] = arg_name
    graph, state = import_exported(ep, name, input_names=names)
    infer_modules(graph)
    if tied:
        graph.attrs["tied"] = tied
    for out in graph.outputs:
        if out.target is not None:
            out.target = out.target.removeprefix("module.")
    if optimizer is not None:
        append_optimizer(graph, optimizer, state, keep_grads=keep_grads)
    return Captured(graph, state)
