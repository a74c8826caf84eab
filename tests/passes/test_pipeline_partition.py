"""Pipeline partition: a training step's forward / backward / optimizer parts, every node's stage
from the forward nodes' stages, and stage subgraphs that run to the whole graph's results."""

import copy

import pytest
import torch

from graphpar.capture import Adam, capture_training
from graphpar.errors import PassError
from graphpar.ir.graph import Graph, OutputRole, Role
from graphpar.ir.parser import parse_program
from graphpar.ir.printer import print_graph, print_program
from graphpar.ir.types import TensorType
from graphpar.ir.verify import verify
from graphpar.models import get_model
from graphpar.passes.pipeline.partition import (
    equal_flops_stages,
    follow_forward,
    forward_backward_optimizer,
    parameter_stages,
    stage_subgraph,
    value_name,
)

F32 = torch.float32


@pytest.fixture(scope="module")
def gpt_step():
    ex = get_model("gpt", "tiny", train=True, batch_size=2)
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets,
                                optimizer=Adam(), keep_grads=True)
    return ex, captured


def small_graph() -> Graph:
    g = Graph("g")
    x = g.add_input("x", TensorType((2, 3), F32))
    w = g.add_input("w", TensorType((3, 4), F32), Role.PARAM)
    y = g.create("matmul", [x, w]).output
    z = g.create("relu", [y]).output
    s = g.create("sum", [z], {"dims": (0, 1)}).output
    g.add_output(s, OutputRole.LOSS)
    return g


def test_stage_subgraph_text():
    g = small_graph()
    relu = g.nodes[1]
    sub = stage_subgraph(g, [relu], "mid")
    assert str(sub) == (
        "graph @mid(\n"
        "    %v0: f32[2,4] input,\n"
        ") {\n"
        "  %0 = relu(%v0)                                        : f32[2,4]    # 8 FLOP\n"
        "  return %0 output\n"
        "}\n")
    assert sub.outputs[0].target == value_name(g, relu.output) == "v1"
    # the loss keeps its role; the parameter keeps its name and role
    first = stage_subgraph(g, [g.nodes[0]], "first")
    assert [(v.name, v.role) for v in first.inputs] == [("x", Role.INPUT), ("w", Role.PARAM)]
    last = stage_subgraph(g, [g.nodes[2]], "last")
    assert [o.role for o in last.outputs] == [OutputRole.LOSS]


def test_parts_of_a_training_step(gpt_step):
    _, captured = gpt_step
    g = captured.graph
    fwd, bwd, opt = forward_backward_optimizer(g)
    assert fwd | bwd | opt == set(g.nodes) and not (fwd & bwd or fwd & opt or bwd & opt)
    loss = next(o.value for o in g.outputs if o.role is OutputRole.LOSS)
    assert loss.producer in fwd
    for out in g.outputs:
        if out.role is OutputRole.GRAD:
            assert out.value.producer in bwd, out.target
        if out.role is OutputRole.UPDATE:
            assert out.value.producer in opt, out.target
    assert all((n.module or "").startswith("optimizer") for n in opt)
    assert not any((n.module or "").startswith("optimizer") for n in bwd)
    # nothing forward reads a backward or optimizer value
    assert all(v.producer in fwd for n in fwd for v in n.input_values if v.producer)


def test_backward_and_update_follow_the_forward(gpt_step):
    _, captured = gpt_step
    g = captured.graph
    fwd, bwd, opt = forward_backward_optimizer(g)
    for stages in (2, 4):
        forward_stage = equal_flops_stages(g, stages)
        stage = follow_forward(g, forward_stage)
        assert set(stage) == set(g.nodes) and set(stage.values()) == set(range(stages))
        for node in g.nodes:
            for v in node.input_values:
                if v.producer in fwd and node in fwd:
                    assert stage[v.producer] <= stage[node]  # activations flow forward
                if v.producer in bwd and node in bwd:
                    assert stage[v.producer] >= stage[node]  # gradients flow back
        home = parameter_stages(g, stage)
        for out in g.outputs:  # a parameter's gradient and update sit on its stage
            if out.role is OutputRole.GRAD:
                assert stage[out.value.producer] == home[out.target], out.target
            if out.role is OutputRole.UPDATE and out.target in home:
                assert stage[out.value.producer] == home[out.target], out.target
        # matmuls of one layer and their gradient matmuls share a stage
        for node in bwd:
            if node.op == "matmul":
                reads = [v for v in node.input_values if v.is_input and v.role is Role.PARAM]
                for p in reads:
                    assert stage[node] == home[p.name]


def test_stage_subgraphs_run_to_the_whole_step(gpt_step):
    ex, captured = gpt_step
    g = captured.graph
    fwd, bwd, opt = forward_backward_optimizer(g)
    stage = follow_forward(g, equal_flops_stages(g, 2))
    env = captured.bind(*ex.inputs, *ex.targets)
    want = captured.run(*ex.inputs, *ex.targets)
    got: dict = {}
    # forward stages in order, backward stages in reverse, then the updates
    order = [(fwd, 0), (fwd, 1), (bwd, 1), (bwd, 0), (opt, 0), (opt, 1)]
    subs = []
    for part, s in order:
        nodes = [n for n in g.nodes if n in part and stage[n] == s]
        sub = stage_subgraph(g, nodes, f"stage{s}")
        verify(sub)
        subs.append(sub)
        from graphpar.backends import reference
        results = reference.run(sub, {v.name: env[v.name] for v in sub.inputs})
        for out, t in zip(sub.outputs, results):
            if out.role is OutputRole.OUTPUT:
                env[out.target] = t
            else:
                got[out.role, out.target] = t
    for out, t in zip(g.outputs, want):
        assert torch.equal(got[out.role, out.target], t), (out.role, out.target)
    # stage programs print and parse back
    program = print_program(subs[:2])
    assert print_program(parse_program(program)) == program


def test_bad_assignments_are_named(gpt_step):
    _, captured = gpt_step
    g = captured.graph
    forward_stage = equal_flops_stages(g, 2)
    first = next(iter(forward_stage))
    with pytest.raises(PassError, match="leaves 1 forward node"):
        follow_forward(g, {n: s for n, s in forward_stage.items() if n is not first})
    flipped = {n: 1 - s for n, s in forward_stage.items()}
    with pytest.raises(PassError, match="sends data backwards"):
        follow_forward(g, flipped)
    with pytest.raises(PassError, match="choose between 1 and"):
        equal_flops_stages(g, 10_000)
    with pytest.raises(PassError, match="no loss output"):
        forward_backward_optimizer(Graph("empty"))


def _messages(program):
    """Every message the MPMD program's graphs send and receive, one per tile:
    {(sending device, receiving device, tag, phase): type} for sends and for receives."""
    sends, recvs = {}, {}
    for graph in program:
        phase = graph.name.split("_")[1]
        for node in graph.nodes:
            a = node.attrs
            if node.op == "send":
                sends[graph.mesh.device_ids[0], a["dst"], a["tag"], phase] = node.inputs[0].type
            elif node.op == "recv":
                recvs[a["src"], graph.mesh.device_ids[0], a["tag"], phase] = node.output.type
            elif node.op == "send_tiles":
                whole = node.inputs[0].type
                tile = (whole if "dim" not in a else TensorType(tuple(
                    n // len(a["dst"]) if d == a["dim"] else n
                    for d, n in enumerate(whole.shape)), whole.dtype))
                assert set(a["src"]) <= set(graph.mesh.device_ids)
                for src, dst in zip(a["src"], a["dst"]):
                    sends[src, dst, a["tag"], phase] = tile
            elif node.op == "recv_tile":
                assert tuple(a["dst"]) == graph.mesh.device_ids  # one tile per device
                for src, dst in zip(a["src"], a["dst"]):
                    recvs[src, dst, a["tag"], phase] = node.output.type
    return sends, recvs


def test_mpmd_program_sends_what_the_stages_exchange(gpt_step):
    from graphpar.ir.graph import Program
    from graphpar.passes.pipeline.lower_mpmd import lower_mpmd, stage_devices, step_bytes_across
    from graphpar.passes.pipeline.stage_programs import split_stages

    _, captured = gpt_step
    g = captured.graph
    programs = split_stages(g, follow_forward(g, equal_flops_stages(g, 4)))
    devices = stage_devices(4, [1, 2, 1, 1])
    assert devices == [(0,), (1, 2), (3,), (4,)]
    program = lower_mpmd(programs, devices)
    assert [gr.name for gr in program][:3] == ["stage0_forward", "stage0_backward",
                                               "stage0_update"]
    for graph in program:
        verify(graph)
    text = print_program(program)
    assert print_program(parse_program(text)) == text
    assert isinstance(parse_program(text), Program)
    # every tile sent has its receive on its device: same tag, same type
    sends, recvs = _messages(program)
    assert sends == recvs and sends
    # the stage sub-meshes are declared in the program
    assert {gr.mesh.device_ids for gr in program} == set(devices)
    # per microbatch, each byte the stages exchange crosses once: what the programs predict
    per_microbatch = sum(t.nbytes for key, t in sends.items() if key[3] != "update")
    assert per_microbatch == sum(sum(programs.bytes_sent(s)) for s in range(4))
    assert step_bytes_across(programs, devices, 4) == programs.step_bytes(4)
    # into the sub-mesh of two devices: each device its tile from stage 0, then the local
    # all-gather; out of it: the tiles of a gradient, sent by both of its devices in turn
    assert programs.types[programs.stages[0].send_forward[0]].shape == (2, 32, 64)
    forward1 = next(gr for gr in program if gr.name == "stage1_forward")
    lines = [" ".join(line.split()) for line in print_graph(forward1).splitlines()
             if line.lstrip().startswith("%") and " = " in line]
    assert lines[:2] == [
        '%0 = recv_tile() {src=[0, 0], dst=[1, 2], shape=[1, 32, 64], dtype="f32", tag=0} '
        ': f32[1,32,64]',
        '%1 = all_gather(%0) {axes=[0], n=2, dim=0} : f32[2,32,64]']
    backward1 = next(gr for gr in program if gr.name == "stage1_backward")
    assert {tuple(n.attrs["src"]) for n in backward1.find("send_tiles")} == {(1,)}
    forward1_sends = forward1.find("send_tiles")
    assert forward1_sends and all(
        (tuple(n.attrs["src"]), tuple(n.attrs["dst"])) == ((1,), (3,)) for n in forward1_sends)
