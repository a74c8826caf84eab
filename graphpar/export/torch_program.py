"""`--to torch`: a device program written out as a standalone per-rank torch program.

`graph_function` prints one IR graph as a straight-line Python function, one torch call per
node with the node's source line as a comment (in the spirit of `torch.fx`'s
`GraphModule.code`); `write_spmd_program` writes `program.py` (those functions, the mesh, the
placements, and `program_support`'s collectives and sharding), `weights.pt` (the state the step
starts from: parameters, buffers, optimizer state, all full tensors) and `README.md`.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from graphpar.errors import UnsupportedOpError
from graphpar.export.torch_code import TUPLE_OPS, expression, literal
from graphpar.ir.graph import Graph, OutputRole, Role, Value
from graphpar.ir.mesh import Mesh
from graphpar.ir.spmd_ops import GROUP_OPS, LOCAL_OPS, node_axes

__all__ = ["graph_function", "program_support_text", "write_spmd_program"]


class _Names:
    """Python identifiers for IR values: node results numbered in order as the IR printer
    numbers them (`%12` -> `v12`), inputs by name (`%model.wte.weight` -> `model_wte_weight`)."""

    def __init__(self) -> None:
        self.names: dict[Value, str] = {}
        self.taken: set[str] = set()
        self.results = 0

    def __getitem__(self, value: Value) -> str:
        if value not in self.names:
            if value.name is None:
                base = f"v{self.results}"
                self.results += 1
            else:
                base = re.sub(r"\W", "_", value.name)
            if not base or base[0].isdigit() or keyword.iskeyword(base) or base in (
                    "torch", "inputs"):
                base = f"v{base}"
            name, k = base, 1
            while name in self.taken:
                name, k = f"{base}_{k}", k + 1
            self.taken.add(name)
            self.names[value] = name
        return self.names[value]


def _where(node) -> str:
    parts = [p for p in (node.loc, node.module) if p]
    return " ".join(parts)


def graph_function(graph: Graph, name: str, doc: str = "") -> str:
    """`graph` as `def name(inputs): ... return [outputs]`: `inputs` maps the graph's input
    names to tensors; every value is freed (`del`) after its last use, as fx's code does."""
    names = _Names()
    last_use: dict[Value, int] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.input_values:
            last_use[v] = i
    kept = {o.value for o in graph.outputs}
    lines = [f"def {name}(inputs):"]
    if doc:
        lines.append(f'    """{doc}"""')
    for v in graph.inputs:
        lines.append(f"    {names[v]} = inputs[{v.name!r}]")
    for i, node in enumerate(graph.nodes):
        args = [names[v] if isinstance(v, Value) else literal(v) for v in node.inputs]
        try:
            expr = expression(node, args)
        except UnsupportedOpError as exc:
            raise UnsupportedOpError(f"graph @{graph.name}: {exc}") from None
        outs = [names[o] for o in node.outputs]
        if len(outs) == 1 and node.op not in TUPLE_OPS:
            target = outs[0]
        else:
            target = ", ".join(outs) + ("," if len(outs) == 1 else "")
        line = f"    {target} = {expr}"
        freed = sorted({names[v] for v in node.input_values
                        if last_use[v] == i and v not in kept and not v.is_input})
        if freed:
            line += f"; del {', '.join(freed)}"
        where = _where(node)
        if where:
            line += f"  # {where}"
        lines.append(line)
    outputs = ", ".join(names[o.value] for o in graph.outputs)
    lines.append(f"    return [{outputs}]")
    return "\n".join(lines) + "\n"


def program_support_text() -> str:
    """`program_support.py` without its docstring: the fixed part of every program."""
    text = (Path(__file__).parent / "program_support.py").read_text()
    return text.split('"""', 2)[2].lstrip("\n")


def axes_used(graphs: Sequence[Graph]) -> list[tuple[int, ...]]:
    """Every mesh-axes group the graphs' collectives and local steps run along, and each
    single axis (outputs are put back together axis by axis)."""
    found = {(a,) for g in graphs for a in range(len(g.mesh.shape) if g.mesh else 0)}
    for g in graphs:
        for node in g.nodes:
            if node.op in GROUP_OPS or node.op in LOCAL_OPS:
                found.add(node_axes(node))
    return sorted(found, key=lambda a: (len(a), a))


def _placements(layout, mesh: Mesh) -> tuple[str, ...]:
    if layout is None:
        return ("R",) * len(mesh.shape)
    return tuple(str(p) for p in layout)


def _table(name: str, entries: dict) -> str:
    body = "".join(f"    {k!r}: {v!r},\n" for k, v in entries.items())
    return f"{name} = {{\n{body}}}\n"


MAIN = '''
def main():
    args = command_line(__doc__.splitlines()[0])
    init(MESH_SHAPE_OF_PLAN, AXES_USED)
    state = torch.load(args.weights, map_location="cpu")
    batch = torch.load(args.inputs, map_location="cpu")
    given = [*batch.get("inputs", []), *batch.get("targets", [])]
    if len(given) != len(USER_INPUTS):
        raise SystemExit(f"{args.inputs}: the step takes {len(USER_INPUTS)} tensors "
                         f"({', '.join(USER_INPUTS)}): inputs then targets; got {len(given)}")
    full = {**state, **dict(zip(USER_INPUTS, given))}
    inputs = {name: shard(full[name], placements).to(DEVICE)
              for name, placements in INPUT_PLACEMENTS.items()}
    results = step(inputs)
    finish_sends()
    results = [unshard(r, placements).cpu() for r, (_, _, placements) in zip(results, OUTPUTS)]
    if RANK == 0:
        save_atomically(outputs_file(results), args.outputs)
    dist.barrier()
    dist.destroy_process_group()


def outputs_file(results):
    """Inference: {"outputs": [...]}; a training step: {"loss", "parameters": {fqn: tensor},
    "state": {name: tensor} (every updated tensor: parameters, buffers, optimizer state)}."""
    if not any(role == "loss" for role, _, _ in OUTPUTS):
        return {"outputs": [r for r, (role, _, _) in zip(results, OUTPUTS) if role == "output"]}
    out = {"parameters": {}, "state": {}, "gradients": {}}
    for r, (role, target, _) in zip(results, OUTPUTS):
        if role == "loss":
            out["loss"] = r
        elif role == "grad":
            out["gradients"][target] = r
        elif role == "update":
            out["state"][target] = r
            if target in PARAMETERS:
                out["parameters"][target] = r
    return out


if __name__ == "__main__":
    main()
'''


def write_spmd_program(spmd: Graph, global_graph: Graph, mesh: Mesh,
                       state: dict[str, torch.Tensor], out: Path, title: str) -> list[str]:
    """Write `program.py`, `weights.pt` and `README.md` for device program `spmd` (its global
    graph `global_graph` names the user's inputs and the parameters); the files written."""
    n = mesh.size
    user_inputs = [v.name for v in global_graph.inputs_with_role(Role.INPUT)]
    params = sorted(v.name for v in global_graph.inputs_with_role(Role.PARAM))
    placements = {v.name: _placements(v.layout, mesh) for v in spmd.inputs}
    outputs = [(o.role.value, o.target, _placements(o.value.layout, mesh))
               for o in spmd.outputs]
    shape = "x".join(map(str, mesh.shape))
    doc = (f"{title} on a {shape} mesh ({n} ranks): one step, exported by graphpar.\n\n"
           f"torchrun --nproc-per-node {n} program.py --inputs IN.pt --outputs OUT.pt\n\n"
           "Imports torch only. Each rank runs `step` on its shard; the collectives run on\n"
           "process groups built for the mesh axes (NCCL on CUDA, gloo on CPU).\n")
    step = graph_function(spmd, "step", f"The device program every rank runs: {spmd.name}.")
    text = "\n".join([
        f'"""{doc}"""\n',
        program_support_text(),
        f"\nMESH_SHAPE_OF_PLAN = {tuple(mesh.shape)!r}",
        f"AXES_USED = {axes_used([spmd])!r}",
        f"USER_INPUTS = {user_inputs!r}",
        f"PARAMETERS = set({params!r})",
        _table("INPUT_PLACEMENTS", placements),
        "OUTPUTS = [  # (role, what it updates or is the gradient of, placements)\n"
        + "".join(f"    {o!r},\n" for o in outputs) + "]\n\n",
        step,
        MAIN,
    ])
    (out / "program.py").write_text(text)
    torch.save({k: t.detach().cpu() for k, t in state.items()}, out / "weights.pt")
    train = any(o.role is OutputRole.LOSS for o in spmd.outputs)
    (out / "README.md").write_text(readme(title, shape, n, user_inputs, train))
    return ["program.py", "weights.pt", "README.md"]


def readme(title: str, shape: str, n: int, user_inputs: list[str], train: bool) -> str:
    result = ('`{"loss": tensor, "parameters": {fqn: tensor}, "state": {...}, "gradients": '
              '{...}}`: the loss and every tensor the step updated, full' if train
              else '`{"outputs": [...]}`: the model\'s outputs, full')
    return f"""# {title}, exported by graphpar

A standalone per-rank PyTorch program for a {shape} mesh ({n} ranks); it imports torch only.

    torchrun --nproc-per-node {n} program.py --inputs IN.pt --outputs OUT.pt

On GPUs (one node, {n} GPUs; NCCL is chosen when CUDA is available):

    torchrun --nnodes 1 --nproc-per-node {n} program.py --inputs IN.pt --outputs OUT.pt

`IN.pt` is `torch.save({{"inputs": [...], "targets": [...]}}, "IN.pt")` of full, unsharded
tensors, in the order {", ".join(user_inputs)}. Every rank reads it and `weights.pt` (the state
the step starts from, full tensors by name) and keeps its own shard. Rank 0 writes `OUT.pt`:
{result}.

`program.py` is one function, `step`, that every rank runs on its shards: one torch call per
node of graphpar's device program, the model's source line as a comment.
"""
