"""Pipeline stages on the CUDA backend: each stage's forward, backward and update programs of a
2-stage MLP training step lower to listings whose CPU runs equal the interpreter phase by
phase, and the MPMD program's send/recv become NCCL send/recv calls that deliver what the
interpreter's send/recv deliver."""

from __future__ import annotations

import copy
from collections import defaultdict, deque

import pytest
import torch

from graphpar.backends.cuda.cpu_executor import CpuListingExecutor
from graphpar.backends.interpreter import Interpreter
from graphpar.capture import Adam, capture_training
from graphpar.ir.cuda_listing import parse_listing, print_listing
from graphpar.ir.graph import OutputRole
from graphpar.models import get_model
from graphpar.passes.lower_cuda import lower_to_listing
from graphpar.passes.pipeline.lower_mpmd import lower_mpmd
from graphpar.passes.pipeline.partition import equal_flops_stages, follow_forward
from graphpar.passes.pipeline.stage_programs import split_stages


@pytest.fixture(scope="module")
def mlp_step():
    ex = get_model("mlp", "tiny", train=True)
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets,
                                optimizer=Adam(), keep_grads=True)
    g = captured.graph
    programs = split_stages(g, follow_forward(g, equal_flops_stages(g, 2)), zero_bubble=False)
    return captured.bind(*ex.inputs, *ex.targets), programs


def _check(graph, inputs, comm=None, listing_comm=None):
    """The graph's listing on the CPU (poisoned) against the interpreter; returns the
    interpreter's outputs."""
    expected = Interpreter(graph, comm).run(inputs)
    listing = parse_listing(print_listing(lower_to_listing(graph, graph.mesh, 0)))
    executor = CpuListingExecutor(listing, listing_comm, poison=True)
    got = executor.run(inputs)
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, i=i: f"@{graph.name} out {i}: {m}")
    assert executor.peak_arena_bytes == listing.arena_bytes
    return expected, listing


def test_each_stage_phase_lowers_and_equals_the_interpreter(mlp_step):
    env, programs = mlp_step
    env = dict(env)
    # one microbatch: forwards in stage order, backwards in reverse, then the updates
    order = [(0, "F"), (1, "F"), (1, "B"), (0, "B"), (0, "U"), (1, "U")]
    phases = 0
    for stage, phase in order:
        graph = programs.stages[stage].program(phase)
        if graph is None:
            continue
        inputs = {v.name: env[v.name] for v in graph.inputs}
        outputs, _ = _check(graph, inputs)
        phases += 1
        for out, t in zip(graph.outputs, outputs):
            if out.role is OutputRole.OUTPUT:
                env[out.target] = t
    assert phases == 6


class _Mailbox:
    """In-process point-to-point messages between global ranks, first in first out per
    (source, destination): what NCCL's send/recv order guarantees."""

    def __init__(self):
        self.queues: dict[tuple[int, int], deque] = defaultdict(deque)

    def endpoint(self, me: int) -> _Endpoint:
        return _Endpoint(self, me)


class _Endpoint:
    def __init__(self, box: _Mailbox, me: int):
        self.box, self.me = box, me

    def send(self, x, dst, tag=0):
        self.box.queues[self.me, dst].append(x.clone())
        return x

    def recv(self, shape, dtype, src, tag=0):
        return self.box.queues[src, self.me].popleft().reshape(shape).to(dtype)

    def execute(self, node, args, index=None):  # the interpreter's send and recv
        if node.op == "send":
            return self.send(args[0], node.attrs["dst"])
        assert node.op == "recv", node.op
        return self.recv(node.output.type.shape, node.output.type.dtype, node.attrs["src"])


def test_mpmd_send_recv_become_nccl_calls_that_deliver_the_same_tensors(mlp_step):
    env, programs = mlp_step
    program = lower_mpmd(programs)
    graphs = {g.name: g for g in program}
    interpreter_box, listing_box = _Mailbox(), _Mailbox()
    sends = 0
    for name in ("stage0_forward", "stage1_forward", "stage1_backward", "stage0_backward"):
        graph = graphs[name]
        me = graph.mesh.device_ids[0]
        inputs = {v.name: env[v.name] for v in graph.inputs if v.name in env}
        missing = [v.name for v in graph.inputs if v.name not in env]
        assert not missing, (name, missing)
        outputs, listing = _check(graph, inputs, interpreter_box.endpoint(me),
                                  listing_box.endpoint(me))
        kinds = listing.calls_by_kind()
        assert kinds.get("nccl.send", 0) == len(list(graph.find("send")))
        assert kinds.get("nccl.recv", 0) == len(list(graph.find("recv")))
        sends += kinds.get("nccl.send", 0)
        for out, t in zip(graph.outputs, outputs):
            if out.role is OutputRole.OUTPUT:
                env[out.target] = t
    assert sends > 0
    assert not any(listing_box.queues.values()) and not any(interpreter_box.queues.values())


def test_tile_sends_become_one_nccl_call_per_tile(mlp_step):
    # stage 1 on two devices: into it every tensor crosses as 2 tiles, each device receives
    # its own; out of it each tile is sent by the device the plan names
    from graphpar.ir.cross_mesh import tile_transfer

    _, programs = mlp_step
    devices = [(0,), (1, 2)]
    program = lower_mpmd(programs, devices)
    sent, received = defaultdict(int), defaultdict(int)
    for graph in program:
        if not graph.find("send_tiles") and not graph.find("recv_tile"):
            continue
        for rank, device in enumerate(graph.mesh.device_ids):
            listing = lower_to_listing(graph, graph.mesh, rank)
            for call in listing.calls:
                if call.kind == "nccl.send":
                    sent[device, call["peer"]] += call["count"] * 4
                elif call.kind == "nccl.recv":
                    received[call["peer"], device] += call["count"] * 4
    assert sent == received and sent
    expected = defaultdict(int)
    for graph in program:
        for node in graph.find("send_tiles"):
            plan = tile_transfer(node.inputs[0].type, devices[0] if 0 in graph.mesh.device_ids
                                 else devices[1], node.attrs["dst"])
            for src, dst in zip(plan.senders, plan.dst):
                expected[src, dst] += plan.tile_type.nbytes
    assert sent == expected
    assert {pair for pair in sent} == {(0, 1), (0, 2), (1, 0)}
