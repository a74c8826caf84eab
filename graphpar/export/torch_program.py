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

__all__ = ["graph_function", "support_text", "write_pipeline_program", "write_spmd_program"]


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


def axes_used(graphs: Sequence[Graph]) -> list[tuple[int, ...]]:
    """Every mesh-axes group the graphs' collectives and local steps run along, each single
    axis and all axes together (what `unshard` reduces and gathers along)."""
    found = set()
    for g in graphs:
        ndim = len(g.mesh.shape) if g.mesh else 0
        found |= {(a,) for a in range(ndim)} | ({tuple(range(ndim))} if ndim else set())
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
    init([(MESH_SHAPE_OF_PLAN, tuple(range(math.prod(MESH_SHAPE_OF_PLAN))))], [AXES_USED])
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
        support_text("program_support"),
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


def support_text(name: str) -> str:
    """The fixed part `name` (a module of this folder) of a program: its text without its
    docstring and without its imports of graphpar (program.py defines those names itself)."""
    text = (Path(__file__).parent / f"{name}.py").read_text().split('"""', 2)[2]
    lines = [line for line in text.splitlines() if not line.startswith("from graphpar")]
    return "\n".join(lines).strip("\n") + "\n"


PHASE_NAMES = {"F": "forward", "B": "backward", "I": "input_grad", "W": "weight_grad",
                   "U": "update"}

def schedule_phases(schedule: str) -> str:
    """The phases a schedule runs: ZB-H1 splits the backward into I and W."""
    return "FIWU" if schedule == "zb" else "FBU"


PIPELINE_MAIN = '''
def main():
    args = command_line(__doc__.splitlines()[0])
    init(MESHES, AXES_USED)
    state = {k: t.to(DEVICE) for k, t in torch.load(args.weights, map_location="cpu").items()}
    batch = torch.load(args.inputs, map_location="cpu")
    given = [*batch.get("inputs", []), *batch.get("targets", [])]
    if len(given) != len(USER_INPUTS):
        raise SystemExit(f"{args.inputs}: the step takes {len(USER_INPUTS)} tensors "
                         f"({', '.join(USER_INPUTS)}): inputs then targets; got {len(given)}")
    chunks = [t.to(DEVICE).chunk(MICROBATCHES) for t in given]
    microbatch_inputs = [dict(zip(USER_INPUTS, parts)) for parts in zip(*chunks)]
    run = run_pipeline(state, microbatch_inputs, MICROBATCHES)
    loss, updates = gather_results(run)
    if RANK == 0:
        save_atomically({"loss": loss, "state": updates,
                         "parameters": {k: t for k, t in updates.items() if k in PARAMETERS}},
                        args.outputs)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def write_pipeline_program(pipe, state: dict[str, torch.Tensor], out: Path, title: str
                           ) -> list[str]:
    """Write `program.py`, `weights.pt` and `README.md` for a pipelined training step `pipe`
    (a `PipelineCompiled`, its stages sharded on their sub-meshes as planned)."""
    from graphpar.ir.schedule import ActionKind
    from graphpar.runtime.pipeline import stage_meshes

    programs = pipe.programs
    meshes = stage_meshes(pipe.stages, pipe.sharded)
    world = sum(m.size for m in meshes)
    global_graph = pipe.captured.graph
    user_inputs = [v.name for v in global_graph.inputs_with_role(Role.INPUT)]
    params = sorted(v.name for v in global_graph.inputs_with_role(Role.PARAM))
    functions, stages, axes = [], [], []
    types = {n: (list(t.shape), t.dtype) for n, t in programs.types.items()}
    for program, mesh in zip(programs.stages, meshes):
        s = program.stage
        phases, device_graphs = {}, []
        for phase in schedule_phases(pipe.schedule_name):
            suffix = PHASE_NAMES[phase]
            graph = program.program(phase)
            if graph is None:
                continue
            sharded = pipe.sharded.get(s, {}).get(phase)
            runs = sharded.device_program if sharded is not None else graph
            if sharded is not None:
                device_graphs.append(runs)
            name = f"stage{s}_{suffix}"
            functions.append(graph_function(runs, name, f"Stage {s}, {suffix}: {runs.name}."))
            phases[phase] = {
                "inputs": [v.name for v in graph.inputs],
                "outputs": [(o.role.value, o.target) for o in graph.outputs],
                "placements_in": None if sharded is None else {
                    v.name: _placements(v.layout, sharded.mesh) for v in runs.inputs},
                "placements_out": None if sharded is None else [
                    _placements(o.value.layout, sharded.mesh) for o in runs.outputs]}
            if phase == "U":
                types.update({v.name: (list(v.type.shape), v.type.dtype) for v in graph.inputs
                              if v.name not in types})
        axes.append(axes_used(device_graphs))
        stages.append({
            "ranks": tuple(mesh.device_ids), "phases": phases,
            "send_forward": list(program.send_forward),
            "send_backward": list(program.send_backward),
            "keep_after_forward": sorted(program.keep_after_forward),
            "grads": list(program.grads),
            "grads_in": [(a, n) for a, b, n in programs.grad_transfers if b == s],
            "grads_out": [(b, n) for a, b, n in programs.grad_transfers if a == s],
            "actions": [(a.kind.value, a.microbatch) for a in pipe.schedule[s]
                        if a.kind in ActionKind]})
    shape = "x".join(map(str, pipe.mesh.shape)) if pipe.mesh is not None else str(world)
    doc = (f"{title}: a {pipe.stages}-stage pipeline ({pipe.schedule_name}, "
           f"{pipe.microbatches} microbatches) on {world} ranks: one training step, exported "
           "by graphpar.\n\n"
           f"torchrun --nproc-per-node {world} program.py --inputs IN.pt --outputs OUT.pt\n\n"
           "Imports torch only. Each rank runs its stage's action list; a stage planned on a\n"
           "sub-mesh runs its phases' device programs over process groups of that sub-mesh.\n")
    phase_table = "".join(f"    ({s}, {p!r}): stage{s}_{PHASE_NAMES[p]},\n"
                          for s, st in enumerate(stages) for p in st["phases"])
    text = "\n".join([
        f'"""{doc}"""\n',
        support_text("program_support"),
        support_text("pipeline_support"),
        f"MESHES = {[(tuple(m.shape), tuple(m.device_ids)) for m in meshes]!r}",
        f"AXES_USED = {axes!r}",
        f"USER_INPUTS = {user_inputs!r}",
        f"PARAMETERS = set({params!r})",
        f"MICROBATCHES = {pipe.microbatches}",
        "TYPES.update({\n" + "".join(f"    {n!r}: ({s!r}, {d}),\n"
                                     for n, (s, d) in sorted(types.items())) + "})",
        "STAGES.extend([\n" + "".join(f"    {st!r},\n" for st in stages) + "])\n\n",
        *functions,
        "\nPHASE_FUNCTIONS.update({\n" + phase_table + "})\n",
        PIPELINE_MAIN,
    ])
    (out / "program.py").write_text(text)
    torch.save({k: t.detach().cpu() for k, t in state.items()}, out / "weights.pt")
    (out / "README.md").write_text(readme(f"{title} ({pipe.stages}-stage pipeline)", shape,
                                          world, user_inputs, True))
    return ["program.py", "weights.pt", "README.md"]
