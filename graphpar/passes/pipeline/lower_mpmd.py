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
stages further on are relayed by the stages between (received and sent on unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from graphpar.errors import PassError
from graphpar.ir.graph import Graph, OutputRole, Program, Value
from graphpar.ir.mesh import Mesh
from graphpar.ir.types import dtype_name
from graphpar.passes.pipeline.stage_programs import PipelinePrograms

__all__ = ["ShardedPhase", "lower_mpmd", "shard_stages", "stage_devices"]


def stage_devices(stages: int, devices_per_stage: Sequence[int] | None = None
                  ) -> list[tuple[int, ...]]:
    """Global ranks of each stage's sub-mesh, stages laid out in order: by default one device
    each."""
    sizes = list(devices_per_stage or [1] * stages)
    if len(sizes) != stages or any(n < 1 for n in sizes):
        raise PassError(f"{stages} stages need {stages} sub-mesh sizes of at least 1, got "
                        f"{sizes}")
    out, first = [], 0
    for n in sizes:
        out.append(tuple(range(first, first + n)))
        first += n
    return out


def lower_mpmd(programs: PipelinePrograms,
               devices: Sequence[Sequence[int]] | None = None) -> Program:
    """The MPMD program of `programs`: graphs `stage<s>_forward`, `stage<s>_backward` and
    `stage<s>_update` for each stage s, each on the sub-mesh `devices[s]` (default: device s).

    Stages on more than one device run their graphs replicated here (every device of the
    sub-mesh the whole stage) and send from their first device to the next stage's first."""
    stages = len(programs.stages)
    devices = [tuple(d) for d in (devices or stage_devices(stages))]
    if len(devices) != stages:
        raise PassError(f"{stages} stages need {stages} sub-meshes, got {len(devices)}")
    meshes = [Mesh((len(d),), d) for d in devices]
    lead = [d[0] for d in devices]  # the device that sends and receives for its stage
    graphs = []
    for program in programs.stages:
        s = program.stage
        previous = programs.stages[s - 1].send_forward if s > 0 else ()
        following = programs.stages[s + 1].send_backward if s + 1 < stages else ()
        forward = _with_transfers(
            programs, program.forward, f"stage{s}_forward", received=previous,
            src=lead[s - 1] if s else None, sent=program.send_forward,
            dst=lead[s + 1] if s + 1 < stages else None,
            returned=sorted(program.keep_after_forward))
        backward = _with_transfers(
            programs, program.backward, f"stage{s}_backward", received=following,
            src=lead[s + 1] if s + 1 < stages else None, sent=program.send_backward,
            dst=lead[s - 1] if s else None, returned=list(program.grads))
        update = _update_with_transfers(programs, s, program.update, lead)
        for g in (forward, backward, update):
            if g is not None:
                g.mesh = meshes[s]
                graphs.append(g)
    return Program.of(graphs)


def _with_transfers(programs: PipelinePrograms, body: Graph | None, name: str, *,
                    received: Sequence[str], src: int | None, sent: Sequence[str],
                    dst: int | None, returned: Sequence[str]) -> Graph | None:
    """`body` (a copy) with receives in front, sends at the end, returning `returned` by name
    (what is available of it) besides its own loss and updates."""
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
        ty = programs.types[value_name]
        recv = graph.create("recv", [], {"src": src, "shape": ty.shape,
                                         "dtype": dtype_name(ty.dtype), "tag": tag},
                            before=first)
        old = available.get(value_name)
        if old is not None and old.is_input:
            graph.replace_all_uses(old, recv.output)
            graph.inputs.remove(old)
        available[value_name] = recv.output
    for tag, value_name in enumerate(sent):
        if value_name not in available:  # a relay this stage neither reads nor makes
            available[value_name] = graph.add_input(value_name, programs.types[value_name])
        graph.create("send", [available[value_name]], {"dst": dst, "tag": tag})
    keep = set(returned)
    graph.outputs = [o for o in graph.outputs
                     if o.role is not OutputRole.OUTPUT or o.target in keep]
    returning = {o.target for o in graph.outputs if o.role is OutputRole.OUTPUT}
    for value_name in returned:
        value = available.get(value_name)
        if value is not None and value_name not in returning and not value.is_input:
            graph.add_output(value, OutputRole.OUTPUT, value_name)
    if not graph.outputs:  # every graph returns something: the last send's operand
        sends = graph.find("send")
        if not sends:
            return None
        graph.add_output(sends[-1].output, OutputRole.OUTPUT, None)
    return graph


def _update_with_transfers(programs: PipelinePrograms, s: int, body: Graph | None,
                           lead: Sequence[int]) -> Graph | None:
    """Stage s's update, sending the gradients other stages update first and receiving the
    ones it updates from others."""
    outgoing = [(dst, n) for src, dst, n in programs.grad_transfers if src == s]
    incoming = [(src, n) for src, dst, n in programs.grad_transfers if dst == s]
    if body is None and not outgoing:
        return None
    graph = body.copy() if body is not None else Graph(f"stage{s}_update")
    graph.name = f"stage{s}_update"
    first = next(iter(graph.nodes), None)
    inputs = graph.inputs_by_name()
    for tag, (dst, value_name) in enumerate(outgoing):
        grad = inputs.get(value_name) or graph.add_input(value_name,
                                                         programs.types[value_name])
        graph.create("send", [grad], {"dst": lead[dst], "tag": tag}, before=first)
    for tag, (src, value_name) in enumerate(incoming):
        ty = programs.types[value_name]
        recv = graph.create("recv", [], {"src": lead[src], "shape": ty.shape,
                                         "dtype": dtype_name(ty.dtype), "tag": tag},
                            before=first)
        old = inputs[value_name]
        graph.replace_all_uses(old, recv.output)
        graph.inputs.remove(old)
    if not graph.outputs:
        graph.add_output(graph.find("send")[-1].output, OutputRole.OUTPUT, None)
    return graph


@dataclass(frozen=True)
class ShardedPhase:
    """One phase of a stage planned on the stage's sub-mesh: the sharded global graph (its
    values carry layouts) and the SPMD program each device of the sub-mesh runs."""

    global_graph: Graph
    device_program: Graph
    mesh: Mesh


def shard_stages(programs: PipelinePrograms, submeshes: Mapping[int, str], *,
                 cluster: str = "cpu", memory_limit: str = "", time_limit: float = 10.0
                 ) -> dict[int, dict[str, ShardedPhase]]:
    """Each phase program of the stages in `submeshes` (stage -> mesh text such as "1x2")
    sharded by the auto-shard ILP on that mesh and lowered to its SPMD device program.

    Phases are planned one by one; what crosses between them (the stash, the gradients, what
    other stages send) is a whole tensor at the phase boundary, gathered from and scattered to
    the phase's layouts by the runtime."""
    from graphpar.passes.autoshard.auto_shard import AutoShard
    from graphpar.passes.manager import PassContext, PassManager, parse_pipeline

    sharded: dict[int, dict[str, ShardedPhase]] = {}
    for s, mesh_text in submeshes.items():
        phases = {}
        for phase in ("F", "B", "I", "W", "U"):
            graph = programs.stages[s].program(phase)
            if graph is None:
                continue
            ctx = PassContext()
            planned = PassManager([AutoShard(mesh=mesh_text, cluster=cluster,
                                             memory_limit=memory_limit,
                                             time_limit=time_limit)]).run(graph.copy(), ctx)
            global_graph = next(iter(planned))
            device = next(iter(PassManager(parse_pipeline("lower-spmd")).run(
                global_graph.copy(), ctx)))
            for out, want in zip(device.outputs, graph.outputs):
                out.target = want.target  # a plain output's name does not survive lowering
            phases[phase] = ShardedPhase(global_graph, device, global_graph.mesh)
        sharded[s] = phases
    return sharded
