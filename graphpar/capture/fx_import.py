"""Imports a torch.export program (an fx graph of ATen ops) into a graphpar IR graph."""

from __future__ import annotations

import operator
import os
import re
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from graphpar.capture.aten_table import Emitter, lowering_for
from graphpar.errors import UnsupportedOpError
from graphpar.ir.graph import Graph, OutputRole, Role, Value
from graphpar.ir.ops import get_op
from graphpar.ir.types import TensorType

_TORCH_DIR = os.path.dirname(torch.__file__)
_GRAPHPAR_DIR = os.path.dirname(os.path.dirname(__file__))
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')

INPUT_ROLES = {
    InputKind.USER_INPUT: Role.INPUT,
    InputKind.PARAMETER: Role.PARAM,
    InputKind.BUFFER: Role.BUFFER,
    InputKind.CONSTANT_TENSOR: Role.CONST,
}


def user_location(stack_trace: str | None) -> str | None:
    """`model.py:42`: the innermost frame of a stack trace that is the user's code, not torch's."""
    if not stack_trace:
        return None
    frames = [(f, int(line)) for f, line in _FRAME.findall(stack_trace)
              if not f.startswith(_TORCH_DIR) and "<" not in f]
    if not frames:
        return None
    return short_location(*frames[-1])


def short_location(filename: str, line: int) -> str:
    path = os.path.abspath(filename)
    cwd = os.getcwd()
    if path.startswith(_GRAPHPAR_DIR + os.sep):  # bundled models: graphpar/models/gpt.py
        path = os.path.relpath(path, os.path.dirname(_GRAPHPAR_DIR))
    elif path.startswith(cwd + os.sep):
        path = os.path.relpath(path, cwd)
    return f"{path}:{line}"


def module_path(meta: dict) -> str | None:
    stack = meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path or None


class _FxEmitter(Emitter):
    def __init__(self, graph: Graph):
        self.graph = graph
        self.module: str | None = None
        self.loc: str | None = None

    def emit(self, op: str, operands: list[Any], attrs: dict[str, Any] | None = None) -> Any:
        attrs = {k: v for k, v in (attrs or {}).items()}
        node = self.graph.create(op, operands, attrs, module=self.module, loc=self.loc)
        if get_op(op).num_outputs == 1:
            return node.outputs[0]
        return node.outputs


def normalize_args(target: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Arguments in schema order, defaults filled in, so each table entry sees one form."""
    schema = target._schema
    values = []
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            values.append(args[i])
        elif arg.name in kwargs:
            values.append(kwargs[arg.name])
        elif arg.has_default_value():
            values.append(arg.default_value)
        else:
            values.append(None)
    return values


def import_exported(ep: ExportedProgram, name: str, input_names: dict[str, str] | None = None
                    ) -> tuple[Graph, dict[str, torch.Tensor]]:
    """The IR graph of `ep` and the tensors of its parameter, buffer and constant inputs."""
    graph = Graph(name)
    emitter = _FxEmitter(graph)
    env: dict[torch.fx.Node, Any] = {}
    state: dict[str, torch.Tensor] = {}
    specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs}
    aliases = _tied_aliases(ep, specs)
    for fx_node in ep.graph.nodes:
        if fx_node.op == "placeholder" and fx_node.name in aliases:
            continue
        if fx_node.op == "placeholder":
            spec = specs[fx_node.name]
            if spec.kind not in INPUT_ROLES:
                raise UnsupportedOpError(f"input {fx_node.name} of kind {spec.kind.name} "
                                         "(tokens, custom objects) is not supported")
            role = INPUT_ROLES[spec.kind]
            value_name = spec.target if role is not Role.INPUT else fx_node.name
            value_name = (input_names or {}).get(value_name, value_name)
            val = fx_node.meta["val"]
            env[fx_node] = graph.add_input(value_name, TensorType(tuple(val.shape), val.dtype),
                                           role)
            if role is not Role.INPUT:
                tensor = ep.state_dict.get(spec.target)
                if tensor is None:
                    tensor = ep.constants[spec.target]
                state[value_name] = tensor.detach()
        elif fx_node.op == "call_function":
            env[fx_node] = _import_call(fx_node, env, emitter)
        elif fx_node.op == "output":
            _import_outputs(ep, fx_node, env, graph, input_names or {})
        else:
            raise UnsupportedOpError(f"fx node kind {fx_node.op!r} ({fx_node.name}) is not "
                                     "supported")
    if aliases:
        rename = (input_names or {}).get
        graph.attrs["tied"] = tuple(sorted(
            (rename(specs[a].target, specs[a].target), rename(specs[b].target, specs[b].target))
            for a, b in aliases.items()))
    return graph, state


def _tied_aliases(ep: ExportedProgram, specs: dict) -> dict[str, str]:
    """Unused placeholders of a tied weight -> the placeholder that carries it.

    torch.export gives each name of a shared parameter its own placeholder and uses one; the
    others are dropped, and `graph.attrs["tied"]` records (alias, carrier) target names.
    """
    users = {n.name: len(n.users) for n in ep.graph.nodes if n.op == "placeholder"}
    weights = {name: ep.state_dict.get(spec.target) for name, spec in specs.items()
               if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER)}
    aliases = {}
    for name, tensor in weights.items():
        if users[name] or tensor is None:
            continue
        carrier = next((other for other, t in weights.items()
                        if other != name and t is tensor and users[other]), None)
        if carrier is not None:
            aliases[name] = carrier
    return aliases


def _import_call(fx_node: torch.fx.Node, env: dict, emitter: _FxEmitter) -> Any:
    target = fx_node.target
    args = torch.fx.node.map_arg(fx_node.args, lambda n: env[n])
    kwargs = torch.fx.node.map_arg(fx_node.kwargs, lambda n: env[n])
    if target is operator.getitem:
        return args[0][args[1]]
    loc = user_location(fx_node.meta.get("stack_trace"))
    lowering = lowering_for(target)
    if lowering is None:
        where = f" at {loc}" if loc else ""
        raise UnsupportedOpError(
            f"unsupported op {target}{where}: graphpar has no IR op for it. Rewrite that line "
            "with supported ops, or add an entry to graphpar/capture/aten_table.py "
            "(see docs/ir.md, 'Adding an op').")
    emitter.module = module_path(fx_node.meta)
    emitter.loc = loc
    try:
        return lowering(emitter, normalize_args(target, args, kwargs))
    except (TypeError, ValueError) as exc:
        where = f" at {loc}" if loc else ""
        raise UnsupportedOpError(f"cannot import {target}{where}: {exc}") from None


_OUTPUT_ROLES = {
    OutputKind.USER_OUTPUT: (OutputRole.OUTPUT, False),
    OutputKind.LOSS_OUTPUT: (OutputRole.LOSS, False),
    OutputKind.BUFFER_MUTATION: (OutputRole.UPDATE, True),
    OutputKind.GRADIENT_TO_PARAMETER: (OutputRole.GRAD, True),
    # a user input exported with requires_grad (token slicing: the keys and values of earlier
    # slices); the target is the input's name
    OutputKind.GRADIENT_TO_USER_INPUT: (OutputRole.GRAD, True),
}


def _import_outputs(ep: ExportedProgram, fx_node: torch.fx.Node, env: dict, graph: Graph,
                    input_names: dict[str, str]) -> None:
    results = fx_node.args[0]
    for spec, result in zip(ep.graph_signature.output_specs, results):
        if spec.kind not in _OUTPUT_ROLES:
            raise UnsupportedOpError(f"output of kind {spec.kind.name} is not supported "
                                     "(in-place updates of user inputs?)")
        if result is None:
            continue
        value = env[result] if isinstance(result, torch.fx.Node) else result
        if not isinstance(value, Value):
            raise UnsupportedOpError(f"output {spec.arg.name} is a constant {value!r}, not a "
                                     "tensor computed by the model")
        role, has_target = _OUTPUT_ROLES[spec.kind]
        target = spec.target
        if spec.kind is OutputKind.GRADIENT_TO_USER_INPUT:
            target = _user_input_of_gradient(ep, target, input_names)
        graph.add_output(value, role, target if has_target else None)


def _user_input_of_gradient(ep: ExportedProgram, target: str, input_names: dict[str, str]
                            ) -> str:
    """The user input a GRADIENT_TO_USER_INPUT output belongs to. torch names it by the joint
    graph's flat argument (`arg<i>_1`: the i-th input spec), not by the input's own name."""
    specs = ep.graph_signature.input_specs
    match = re.fullmatch(r"arg(\d+)_1", target)
    if match is None or int(match.group(1)) >= len(specs) or (
            specs[int(match.group(1))].kind is not InputKind.USER_INPUT):
        raise UnsupportedOpError(f"cannot tell which input the gradient output {target!r} "
                                 "belongs to")
    name = specs[int(match.group(1))].arg.name
    return input_names.get(name, name)
