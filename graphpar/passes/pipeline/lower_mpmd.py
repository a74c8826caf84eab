"""Lowering a pipeline to its MPMD program: per stage, its forward, backward and update as IR
graphs declared on the stage's sub-mesh, with the transfers between stages as explicit `send`
and `recv` ops (`graphpar.ir.spmd_ops`).

The program is what each stage runs, written out: printable, parseable, verifiable. A stage's
forward graph starts with the receives of what the previous stage sends it, runs the stage's
forward nodes and ends with the sends to the next stage; it returns what its backward reads
(the stash). The backward receives the next stage's gradients, sends its own to the previous
stage and returns the gradients it adds to its accumulators; the update reads their means. A
gradient another stage's update reads is sent at the start of the producer's update graph.

Each value crossing from one stage to the next is sent once per microbatch; values bound for
stages further on are relayed by the stages between (received and sent on unchanged). Between
sub-meshes of several devices a value crosses as tiles, each tile once, and the receiving
sub-mesh all-gathers them (Alpa's local all-gather, `graphpar.ir.cross_mesh`); the pipeline
runtime executes the same tile plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from graphpar.cost.limits import PlanLimits
from graphpar.errors import PassError
from graphpar.ir.cross_mesh import TileTransfer, stage_devices, tile_transfer
from graphpar.ir.graph import Graph, OutputRole, Program, Value
from graphpar.ir.mesh import Mesh
from graphpar.ir.types import TensorType, dtype_name
from graphpar.passes.pipeline.stage_programs import PipelinePrograms

__all__ = ["ShardedPhase", "lower_mpmd", "shard_stages", "stage_devices", "step_bytes_across",
           "transfers"]


def lower_mpmd(programs: PipelinePrograms,
               devices: Sequence[Sequence[int]] | None = None) -> Program:
    """The MPMD program of `programs`: graphs `stage<s>_forward`, `stage<s>_backward` and
    `stage<s>_update` for each stage s, each on the sub-mesh `devices[s]` (default: device s).

    Every device of a sub-mesh runs its stage's graphs (here unsharded; `shard_stages` plans
    the phases' SPMD programs). Between two single devices a tensor is a `send` and a `recv`;
    where either side has several devices it crosses as tiles (`graphpar.ir.cross_mesh`):
    `send_tiles` on the sender, `recv_tile` and an `all_gather` over the receiving sub-mesh."""
    stages = len(programs.stages)
    devices = [tuple(d) for d in (devices or stage_devices(stages))]
    if len(devices) != stages:
        raise PassError(f"{stages} stages need {stages} sub-meshes, got {len(devices)}")
    meshes = [Mesh((len(d),), d) for d in devices]
    graphs = []
    for program in programs.stages:
        s = program.stage
        previous = programs.stages[s - 1].send_forward if s > 0 else ()
        following = programs.stages[s + 1].send_backward if s + 1 < stages else ()
        forward = _with_transfers(
            programs, program.forward, f"stage{s}_forward", devices[s], received=previous,
            src=devices[s - 1] if s else None, sent=program.send_forward,
            dst=devices[s + 1] if s + 1 < stages else None,
            returned=sorted(program.keep_after_forward))
        backward = _with_transfers(
            programs, program.backward, f"stage{s}_backward", devices[s], received=following,
            src=devices[s + 1] if s + 1 < stages else None, sent=program.send_backward,
            dst=devices[s - 1] if s else None, returned=list(program.grads))
        update = _update_with_transfers(programs, s, program.update, devices)
        for g in (forward, backward, update):
            if g is not None:
                g.mesh = meshes[s]
                graphs.append(g)
    return Program.of(graphs)


_SENDS = ("send", "send_tiles")


def _receive(graph: Graph, ty: TensorType, src: Sequence[int], here: Sequence[int], tag: int,
             before) -> Value:
    """The nodes that receive a `ty` tensor from sub-mesh `src` on sub-mesh `here`; the
    tensor, whole on every device of `here`."""
    if len(src) == 1 and len(here) == 1:
        return graph.create("recv", [], {"src": src[0], "shape": ty.shape,
                                         "dtype": dtype_name(ty.dtype), "tag": tag},
                            before=before).output
    plan = tile_transfer(ty, src, here)
    tile = plan.tile_type
    value = graph.create("recv_tile", [], {"src": list(plan.senders), "dst": list(plan.dst),
                                           "shape": tile.shape, "dtype": dtype_name(ty.dtype),
                                           "tag": tag}, before=before).output
    if plan.gathered:  # Alpa's local all-gather, over the receiving sub-mesh's own links
        value = graph.create("all_gather", [value], {"axes": [0], "n": plan.tiles,
                                                     "dim": plan.dim}, before=before).output
    return value


def _send(graph: Graph, value: Value, here: Sequence[int], dst: Sequence[int], tag: int,
          before=None) -> None:
    """The node that sends `value` (whole on every device of `here`) to sub-mesh `dst`."""
    if len(here) == 1 and len(dst) == 1:
        graph.create("send", [value], {"dst": dst[0], "tag": tag}, before=before)
        return
    plan = tile_transfer(value.type, here, dst)
    attrs = {"src": list(plan.senders), "dst": list(plan.dst), "tag": tag}
    if plan.dim is not None:
        attrs["dim"] = plan.dim
    graph.create("send_tiles", [value], attrs, before=before)


def _with_transfers(programs: PipelinePrograms, body: Graph | None, name: str,
                    here: Sequence[int], *, received: Sequence[str], src: Sequence[int] | None,
                    sent: Sequence[str], dst: Sequence[int] | None, returned: Sequence[str]
                    ) -> Graph | None:
    """`body` (a copy) on sub-mesh `here` with receives in front, sends at the end, returning
    `returned` by name (what is available of it) besides its own loss and updates."""
    if body is None and not received and not sent:
        return None
    graph = body.copy() if body is not None else Graph(name)
    graph.name = name
    available: dict[str, Value] = {}
    for v in graph.inputs:
        available[v.name] = v
    for out in graph.outputs:
        if out.role is OutputRole.OUTPUT:
            available[out.target] = out.value
    first = next(iter(graph.nodes), None)
    for tag, value_name in enumerate(received):
        value = _receive(graph, programs.types[value_name], src, here, tag, first)
        old = available.get(value_name)
        if old is not None and old.is_input:
            graph.replace_all_uses(old, value)
            graph.inputs.remove(old)
        available[value_name] = value
    for tag, value_name in enumerate(sent):
        if value_name not in available:  # a relay this stage neither reads nor makes
            available[value_name] = graph.add_input(value_name, programs.types[value_name])
        _send(graph, available[value_name], here, dst, tag)
    keep = set(returned)
    graph.outputs = [o for o in graph.outputs
                     if o.role is not OutputRole.OUTPUT or o.target in keep]
    returning = {o.target for o in graph.outputs if o.role is OutputRole.OUTPUT}
    for value_name in returned:
        value = available.get(value_name)
        if value is not None and value_name not in returning and not value.is_input:
            graph.add_output(value, OutputRole.OUTPUT, value_name)
    if not graph.outputs:  # every graph returns something: the last send's operand
        sends = [n for n in graph.nodes if n.op in _SENDS]
        if not sends:
            return None
        graph.add_output(sends[-1].output, OutputRole.OUTPUT, None)
    return graph


def _update_with_transfers(programs: PipelinePrograms, s: int, body: Graph | None,
                           devices: Sequence[Sequence[int]]) -> Graph | None:
    """Stage s's update, sending the gradients other stages update first and receiving the
    ones it updates from others."""
    # a gradient's tag is its place in grad_transfers: the same for its sender and receiver
    outgoing = [(tag, dst, n) for tag, (src, dst, n) in enumerate(programs.grad_transfers)
                if src == s]
    incoming = [(tag, src, n) for tag, (src, dst, n) in enumerate(programs.grad_transfers)
                if dst == s]
    if body is None and not outgoing:
        return None
    graph = body.copy() if body is not None else Graph(f"stage{s}_update")
    graph.name = f"stage{s}_update"
    first = next(iter(graph.nodes), None)
    inputs = graph.inputs_by_name()
    for tag, dst, value_name in outgoing:
        grad = inputs.get(value_name) or graph.add_input(value_name,
                                                         programs.types[value_name])
        _send(graph, grad, devices[s], devices[dst], tag, before=first)
    for tag, src, value_name in incoming:
        value = _receive(graph, programs.types[value_name], devices[src], devices[s], tag,
                         first)
        old = inputs[value_name]
        graph.replace_all_uses(old, value)
        graph.inputs.remove(old)
    if not graph.outputs:
        sends = [n for n in graph.nodes if n.op in _SENDS]
        graph.add_output(sends[-1].output, OutputRole.OUTPUT, None)
    return graph


def transfers(programs: PipelinePrograms, devices: Sequence[Sequence[int]]
              ) -> list[tuple[str, int, int, TileTransfer]]:
    """Every tensor that crosses between stages once per microbatch ("F", "B") or once per
    step ("U", the gradients another stage updates): (phase, from stage, to stage, plan)."""
    out = []
    for program in programs.stages:
        s = program.stage
        for name in program.send_forward:
            out.append(("F", s, s + 1,
                        tile_transfer(programs.types[name], devices[s], devices[s + 1])))
        for name in program.send_backward:
            out.append(("B", s, s - 1,
                        tile_transfer(programs.types[name], devices[s], devices[s - 1])))
    for src, dst, name in programs.grad_transfers:
        out.append(("U", src, dst,
                    tile_transfer(programs.types[name], devices[src], devices[dst])))
    return out


def step_bytes_across(programs: PipelinePrograms, devices: Sequence[Sequence[int]],
                      microbatches: int) -> int:
    """Bytes that cross between sub-meshes in one step of `microbatches` microbatches, every
    tensor as its tiles (`PipelinePrograms.step_bytes` when every tensor tiles evenly)."""
    return sum(plan.bytes_across * (1 if phase == "U" else microbatches)
               for phase, _, _, plan in transfers(programs, devices))


@dataclass(frozen=True)
class ShardedPhase:
    """One phase of a stage planned on the stage's sub-mesh: the sharded global graph (its
    values carry layouts) and the SPMD program each device of the sub-mesh runs."""

    global_graph: Graph
    device_program: Graph
    mesh: Mesh


def shard_stages(programs: PipelinePrograms, submeshes: Mapping[int, Mesh],
                 limits: PlanLimits) -> dict[int, dict[str, ShardedPhase]]:
    """Each phase program of the stages in `submeshes` (stage -> its mesh, on a cluster)
    sharded by the auto-shard ILP on that mesh within `limits` (the user's: memory per device,
    seconds per solve) and lowered to its SPMD device program.

    Phases are planned one by one; what crosses between them (the stash, the gradients, what
    other stages send) is a whole tensor at the phase boundary, gathered from and scattered to
    the phase's layouts by the runtime."""
    from graphpar.passes.autoshard.auto_shard import AutoShard
    from graphpar.passes.manager import PassContext, PassManager, parse_pipeline

    sharded: dict[int, dict[str, ShardedPhase]] = {}
    for s, mesh in submeshes.items():
        phases = {}
        for phase in ("F", "B", "I", "W", "U"):
            graph = programs.stages[s].program(phase)
            if graph is None:
                continue
            ctx = PassContext()
            planned = PassManager([AutoShard.of(mesh, limits)]).run(graph.copy(), ctx)
            global_graph = next(iter(planned))
            device = next(iter(PassManager(parse_pipeline("lower-spmd")).run(
                global_graph.copy(), ctx)))
            for out, want in zip(device.outputs, graph.outputs):
                out.target = want.target  # a plain output's name does not survive lowering
            phases[phase] = ShardedPhase(global_graph, device, global_graph.mesh)
        sharded[s] = phases
    return sharded
