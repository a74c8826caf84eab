"""`--to dtensor`: the plan as DTensor placements for the user's own module and loop.

`plan_json` writes what a device program planned in torch.distributed.tensor's vocabulary: the
mesh, each parameter's placements by FQN, the placements the plan wants of the module's inputs
(and, for inference, outputs), and the collectives the plan issues per step. `apply_plan` reads
it back onto a module on a `DeviceMesh`: parameters become DTensors (`distribute_tensor`), a
forward pre-hook lays the inputs (full tensors on every rank) out as planned, and a forward hook
hands the outputs back as full tensors (or as the DTensors DTensor's propagation made).
`count_collectives` runs a step under `CommDebugMode`: what DTensor actually issues, to report
beside the plan's own count.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graphpar.errors import ShardingError, UsageError
from graphpar.ir.graph import Graph, Role
from graphpar.ir.layout import Partial, Shard
from graphpar.ir.mesh import Mesh
from graphpar.ir.spmd_ops import GROUP_OPS

__all__ = ["FORMAT", "apply_plan", "count_collectives", "plan_json"]

FORMAT = "graphpar-dtensor-plan/1"


def _placement_text(p) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return "Replicate()"


def _placements(layout, ndim: int) -> list[str]:
    return ["Replicate()"] * ndim if layout is None else [_placement_text(p) for p in layout]


def plan_json(spmd: Graph, global_graph: Graph, mesh: Mesh, model: str, mode: str,
              module_inputs: int) -> dict:
    """The plan of device program `spmd` (of `global_graph` on `mesh`) as plan.json's dict;
    the first `module_inputs` user inputs are the module's (the rest are the loss's targets)."""
    ndim = len(mesh.shape)
    types = {v.name: v.type for v in global_graph.inputs}
    params = {v.name: {"placements": _placements(v.layout, ndim),
                       "shape": list(types[v.name].shape), "dtype": str(v.type.dtype)}
              for v in spmd.inputs if v.role is Role.PARAM}
    buffers = {v.name: {"placements": _placements(v.layout, ndim),
                        "shape": list(types[v.name].shape)}
               for v in spmd.inputs if v.role is Role.BUFFER}
    user = [v for v in spmd.inputs if v.role is Role.INPUT][:module_inputs]
    planned = Counter(n.op for n in spmd.nodes if n.op in GROUP_OPS)
    return {
        "format": FORMAT, "model": model, "mode": mode,
        "mesh": {"dim_names": [f"axis{a}" for a in range(ndim)], "shape": list(mesh.shape)},
        "parameters": params, "buffers": buffers,
        "inputs": [{"name": v.name, "shape": list(types[v.name].shape),
                    "placements": _placements(v.layout, ndim)} for v in user],
        # an inference plan's outputs; a training plan's outputs are its loss and updates,
        # not the module's: those come back full
        "outputs": ([{"placements": _placements(o.value.layout, ndim)} for o in spmd.outputs]
                    if mode == "infer" else None),
        "collectives_planned": dict(sorted(planned.items())),
    }


_PLACEMENT = re.compile(r"Shard\((\d+)\)|Replicate\(\)|Partial\((\w+)\)")


def _dtensor_placements(texts: list[str], where: str):
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    out = []
    for text in texts:
        m = _PLACEMENT.fullmatch(text)
        if m is None:
            raise ShardingError(f"{where}: {text!r} is not a placement (Shard(d), Replicate() "
                                "or Partial(op))")
        if m.group(1) is not None:
            out.append(DShard(int(m.group(1))))
        elif m.group(2) is not None:
            out.append(DPartial(m.group(2)))
        else:
            out.append(DReplicate())
    return out


def read_plan(path: str | Path) -> dict:
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the plan: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not a JSON plan ({exc}); write one with graphpar export "
                         "--to dtensor") from None
    if not isinstance(plan, dict) or plan.get("format") != FORMAT:
        raise UsageError(f"{path}: not a graphpar DTensor plan (format {FORMAT!r}); write one "
                         "with graphpar export --to dtensor")
    return plan


def check_plan(plan: dict, module: torch.nn.Module, mesh_shape: tuple[int, ...],
               where: str = "plan") -> None:
    """The plan fits the module (every parameter by name and shape) and the mesh (its
    shape); else ShardingError naming the first thing that does not."""
    named = dict(module.named_parameters(remove_duplicate=False))
    unknown = sorted(set(plan["parameters"]) - set(named))
    if unknown:
        raise ShardingError(f"{where}: parameter {unknown[0]!r} is not in the module "
                            f"({type(module).__name__}; {len(unknown)} unknown): the plan was "
                            "made for another model; export it from this one")
    planned_ids = {id(named[n]) for n in plan["parameters"]}
    missing = sorted(n for n, p in named.items() if id(p) not in planned_ids)
    if missing:
        raise ShardingError(f"{where}: the module's parameter {missing[0]!r} has no placements "
                            "in the plan: it was made for another model; export it from this "
                            "one")
    for name, entry in plan["parameters"].items():
        if list(named[name].shape) != entry["shape"]:
            raise ShardingError(f"{where}: parameter {name!r} is {list(named[name].shape)} in "
                                f"the module but {entry['shape']} in the plan")
    shape = plan["mesh"]["shape"]
    if list(mesh_shape) != shape:
        raise ShardingError(f"{where}: the plan is for a {'x'.join(map(str, shape))} mesh, "
                            f"the DeviceMesh given is {'x'.join(map(str, mesh_shape))}: make "
                            f"the mesh init_device_mesh(device, {tuple(shape)})")


def apply_plan(module: torch.nn.Module, plan: str | Path | dict, device_mesh,
               outputs: str = "full") -> torch.nn.Module:
    """Distribute `module`'s parameters (and buffers) on `device_mesh` as `plan` (a plan.json
    path or its dict) places them, and install hooks: inputs (full tensors, the same on every
    rank) are laid out as the plan wants them; outputs come back as full tensors
    (`outputs="full"`) or as DTensors (`outputs="dtensor"`). Returns `module`, changed in
    place. A plan that does not fit the module or the mesh raises ShardingError naming what."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    where = str(plan) if not isinstance(plan, dict) else "plan"
    plan = read_plan(plan) if not isinstance(plan, dict) else plan
    if outputs not in ("full", "dtensor"):
        raise UsageError(f"outputs={outputs!r}: give 'full' or 'dtensor'")
    check_plan(plan, module, tuple(device_mesh.shape), where)
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        parent, _, leaf = name.rpartition(".")
        owners.setdefault(id(p), []).append((module.get_submodule(parent), leaf))
    named = dict(module.named_parameters(remove_duplicate=False))
    for name, entry in plan["parameters"].items():
        param = named[name]
        placements = _dtensor_placements(entry["placements"], f"{where}: {name}")
        if any(p.is_partial() for p in placements):
            placements = [p if not p.is_partial() else _dtensor_placements(
                ["Replicate()"], where)[0] for p in placements]  # a parameter is never partial
        new = torch.nn.Parameter(distribute_tensor(param.detach(), device_mesh, placements),
                                 requires_grad=param.requires_grad)
        for owner, leaf in owners.pop(id(param), []):
            setattr(owner, leaf, new)
    buffers = plan.get("buffers") or {}
    for name, buffer in list(module.named_buffers()):
        texts = buffers.get(name, {}).get("placements", ["Replicate()"] * device_mesh.ndim)
        parent, _, leaf = name.rpartition(".")
        module.get_submodule(parent).register_buffer(
            leaf, distribute_tensor(buffer, device_mesh, _dtensor_placements(texts, where)))
    layouts = [_dtensor_placements(i["placements"], f"{where}: input {i['name']}")
               for i in plan["inputs"]]

    # plain tensors a model makes inside its forward (position ids from arange, masks) meet
    # DTensor parameters: DTensor takes them as replicated while the module runs
    entered = []

    def lay_out_inputs(_module, args):
        from torch.distributed.tensor.experimental import implicit_replication

        entered.append(implicit_replication())
        entered[-1].__enter__()
        return tuple(distribute_tensor(a, device_mesh, layouts[i])
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                     and i < len(layouts) else a for i, a in enumerate(args))

    def hand_back(_module, _args, result):
        if entered:
            entered.pop().__exit__(None, None, None)
        if outputs == "dtensor" or result is None:
            return result
        return _full(result)

    _replicate_plain_inputs(module, device_mesh)
    module.register_forward_pre_hook(lay_out_inputs)
    module.register_forward_hook(hand_back, always_call=True)
    return module


def _replicate_plain_inputs(module: torch.nn.Module, device_mesh) -> None:
    """Each submodule that holds DTensor parameters gets its plain-tensor inputs (args and
    kwargs) as Replicate DTensors, as DTensor's own ParallelStyles lay out module inputs.
    implicit_replication covers such tensors in the forward only: the autograd graph keeps the
    plain tensor (GPT-2's position ids, made by arange inside its forward), and the op's
    backward (embedding_dense_backward) then meets it beside a DTensor gradient and refuses.
    Made a DTensor at the module boundary, it is saved as one. Every rank holds the same
    tensor, so `from_local` lays it out without communicating."""
    from torch.distributed.tensor import DTensor, Replicate

    replicate = [Replicate()] * device_mesh.ndim

    def as_dtensor(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, device_mesh, replicate, run_check=False)
        return value

    def hook(_module, args, kwargs):
        return (tuple(as_dtensor(a) for a in args),
                {k: as_dtensor(v) for k, v in kwargs.items()})

    for sub in module.modules():
        if sub is not module and any(isinstance(p, DTensor)
                                     for p in sub.parameters(recurse=False)):
            sub.register_forward_pre_hook(hook, with_kwargs=True)


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, (tuple, list)):
        return type(value)(_full(v) for v in value)
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if hasattr(value, "to_tuple") and hasattr(value, "keys"):  # a transformers ModelOutput
        for k in list(value.keys()):
            value[k] = _full(value[k])
    return value


def count_collectives(step: Callable[[], Any]) -> dict[str, int]:
    """Run `step()` (a forward and backward of the distributed module) under DTensor's
    `CommDebugMode`: the collectives DTensor issued, by name (all_reduce, all_gather,
    reduce_scatter, all_to_all), counted."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        step()
    counts: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(getattr(op, "__name__", op)).split(".")[-1]
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            if kind in name:
                counts[kind] += n
                break
        else:
            counts[name] += n
    return dict(sorted(counts.items()))
