"""SPMD ops: types, text, every collective and local step in-process against an independent
oracle (layouts and numpy), and cost-model resharding plans emitted with `emit_step`."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from graphpar.backends.reference import run
from graphpar.cost.communication import Step, StepKind, all_reduce_cost, resharding_cost
from graphpar.errors import BackendError, VerificationError
from graphpar.ir.graph import Graph
from graphpar.ir.layout import Layout, Partial, Replicate, Shard, all_layouts
from graphpar.ir.mesh import Mesh
from graphpar.ir.ops import get_op
from graphpar.ir.parser import parse
from graphpar.ir.printer import node_flops, print_graph
from graphpar.ir.spmd_ops import SPMD_OPS
from graphpar.ir.types import TensorType
from graphpar.ir.verify import verify
from graphpar.passes.lower_spmd import emit_step
from graphpar.runtime.spmd import run_spmd_in_process, shard_tensor, unshard

MESHES = [(4,), (2, 2), (2, 4), (2, 2, 2)]
SHAPE = (8, 8, 8)


def _subsets(ndim: int) -> list[tuple[int, ...]]:
    return [c for k in range(1, ndim + 1) for c in itertools.combinations(range(ndim), k)]


CASES = [(shape, axes) for shape in MESHES for axes in _subsets(len(shape))]


def _ids(case):
    shape, axes = case
    return f"{'x'.join(map(str, shape))}-axes{''.join(map(str, axes))}"


def _one_op(op: str, local_shape, attrs: dict, mesh: Mesh) -> Graph:
    g = Graph("t", mesh=mesh)
    x = g.add_input("x", TensorType(tuple(local_shape), torch.float32))
    g.add_output(g.create(op, [x], attrs).output)
    verify(g)
    return g


def _layout(mesh: Mesh, axes, on_axes, others=None) -> Layout:
    """`on_axes` on the collective's axes; `others` (default R) on the rest."""
    return Layout(tuple(on_axes if a in axes else (others or Replicate())
                        for a in range(mesh.ndim)))


def _global(seed=0, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, shape, generator=g).float()  # integers: sums are exact


def _run_layouts(op, attrs, mesh, src: Layout, x: torch.Tensor):
    inputs = [{"x": shard_tensor(x, src, mesh, d)} for d in mesh.device_ids]
    g = _one_op(op, inputs[0]["x"].shape, attrs, mesh)
    return run_spmd_in_process(g, inputs, mesh)


def _position(mesh: Mesh, device: int, axes) -> int:
    coord = mesh.coordinate(device)
    return int(np.ravel_multi_index([coord[a] for a in axes], [mesh.shape[a] for a in axes]))


def _peers(mesh: Mesh, device: int, axes) -> list[int]:
    """The group of `device` along `axes` in position order, computed from coordinates."""
    coord = mesh.coordinate(device)
    out = {}
    for d in mesh.device_ids:
        c = mesh.coordinate(d)
        if all(c[a] == coord[a] for a in range(mesh.ndim) if a not in axes):
            out[_position(mesh, d, axes)] = d
    return [out[i] for i in range(len(out))]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_all_gather_all_to_all_and_local_steps_match_layouts(case):
    mesh = Mesh(case[0])
    axes = case[1]
    n = mesh.group_size(axes)
    x = _global(1)
    rest = Shard(2)  # the other axes shard another dim, so groups differ from each other
    # all_gather: S(0) -> R on `axes`
    out = _run_layouts("all_gather", {"axes": axes, "n": n, "dim": 0}, mesh,
                       _layout(mesh, axes, Shard(0), rest), x)
    for rank, d in enumerate(mesh.device_ids):
        assert torch.equal(out[rank][0], shard_tensor(x, _layout(mesh, axes, Replicate(), rest),
                                                      mesh, d))
    assert out.bytes_sent == [(n - 1) / n * out[0][0].nbytes] * mesh.size
    # all_to_all: S(0) -> S(1) on `axes`
    out = _run_layouts("all_to_all", {"axes": axes, "n": n, "split_dim": 1, "concat_dim": 0},
                       mesh, _layout(mesh, axes, Shard(0), rest), x)
    dst = _layout(mesh, axes, Shard(1), rest)
    for rank, d in enumerate(mesh.device_ids):
        assert torch.equal(out[rank][0], shard_tensor(x, dst, mesh, d))
    # local_slice: R -> S(1)
    out = _run_layouts("local_slice", {"axes": axes, "n": n, "dim": 1}, mesh,
                       _layout(mesh, axes, Replicate(), rest), x)
    for rank, d in enumerate(mesh.device_ids):
        assert torch.equal(out[rank][0], shard_tensor(x, dst, mesh, d))
    assert out.bytes_sent == [0.0] * mesh.size and out.records == [[]] * mesh.size
    # local_pad: S(1) -> P(sum); local_zero: R -> P(sum)
    for op, src, attrs in (("local_pad", dst, {"dim": 1}), ("local_zero", Layout.replicated(
            mesh.ndim), {"op": "sum"})):
        src = _layout(mesh, axes, src[axes[0]], rest)
        out = _run_layouts(op, {"axes": axes, "n": n, **attrs}, mesh, src, x)
        partial = _layout(mesh, axes, Partial(), rest)
        assert torch.equal(unshard([o[0] for o in out], partial, mesh), x)
        for rank, d in enumerate(mesh.device_ids):
            position = _position(mesh, d, axes)
            local = out[rank][0]
            if op == "local_zero":
                expect = shard_tensor(x, src, mesh, d) if position == 0 else 0 * local
            else:
                expect = torch.zeros_like(local)
                size = local.shape[1] // n
                expect[:, position * size:(position + 1) * size] = shard_tensor(x, src, mesh, d)
            assert torch.equal(local, expect), (op, d)


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_all_reduce_and_reduce_scatter_match_numpy(case, op):
    mesh = Mesh(case[0])
    axes = case[1]
    n = mesh.group_size(axes)
    xs = [_global(10 + r, (8, 4)) for r in range(mesh.size)]  # a different partial per rank
    inputs = [{"x": x} for x in xs]
    reduce = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}[op]
    ar = run_spmd_in_process(_one_op("all_reduce", (8, 4), {"axes": axes, "n": n, "op": op},
                                     mesh), inputs, mesh)
    rs = run_spmd_in_process(_one_op("reduce_scatter", (8, 4), {"axes": axes, "n": n, "dim": 0,
                                                                "op": op}, mesh), inputs, mesh)
    for rank, d in enumerate(mesh.device_ids):
        group = [mesh.device_ids.index(p) for p in _peers(mesh, d, axes)]
        expect = reduce(np.stack([xs[g].numpy() for g in group]), axis=0)
        assert np.array_equal(ar[rank][0].numpy(), expect)
        chunk = np.split(expect, n, axis=0)[_position(mesh, d, axes)]
        assert np.array_equal(rs[rank][0].numpy(), chunk)
    nbytes = 8 * 4 * 4
    assert ar.bytes_sent == [all_reduce_cost(nbytes, mesh, axes).bytes_sent] * mesh.size
    assert rs.bytes_sent == [(n - 1) / n * nbytes] * mesh.size
    assert [r.node for r in rs.records[0]] == [0]


def test_local_zero_for_max_keeps_every_copy():
    mesh = Mesh((2, 2))
    x = _global(3, (4, 4))
    out = run_spmd_in_process(_one_op("local_zero", (4, 4), {"axes": (0, 1), "n": 4,
                                                             "op": "max"}, mesh),
                              [{"x": x}] * 4, mesh)
    assert all(torch.equal(o[0], x) for o in out)
    assert torch.equal(unshard([o[0] for o in out], Layout.parse("{P(max),P(max)}"), mesh), x)


# ------------------------------------------------------------------------- resharding plans

def _plan_cases():
    rng = random.Random(0)
    cases = []
    for shape, tensor in (((2, 2), (8, 8)), ((2, 4), (8, 8)), ((2, 2, 2), (4, 8, 4))):
        mesh = Mesh(shape)
        layouts = all_layouts(tensor, mesh, include_partial=True)
        pairs = list(itertools.product(layouts, layouts))
        rng.shuffle(pairs)
        cases += [(shape, tensor, str(s), str(d)) for s, d in pairs[:60]]
    cases += [((2, 4), (8, 8), "{P(max),S(1)}", "{R,R}"), ((2, 4), (8, 8), "{R,R}", "{P(min),R}"),
              ((2, 4), (8, 8), "{P(avg),S(0)}", "{S(1),R}")]
    return cases


@pytest.mark.parametrize("shape,tensor,src,dst", _plan_cases())
def test_resharding_plans_run_exactly_with_predicted_bytes(shape, tensor, src, dst):
    """lower-spmd's job for one edge: emit the cost model's steps; the result holds the
    tensor in `dst` and every rank sends exactly the predicted bytes."""
    mesh = Mesh(shape)
    src, dst = Layout.parse(src), Layout.parse(dst)
    x = _global(5, tensor)
    cost = resharding_cost(tensor, 4, src, dst, mesh)
    g = Graph("edge", mesh=mesh)
    v = g.add_input("x", TensorType(src.local_shape(tensor, mesh), torch.float32))
    for step in cost.steps:
        v = emit_step(g, step, v)
    g.add_output(v)
    verify(g)
    assert parse(print_graph(g)) == g
    assert v.type.shape == dst.local_shape(tensor, mesh)
    out = run_spmd_in_process(g, [{"x": shard_tensor(x, src, mesh, d)} for d in mesh.device_ids],
                              mesh)
    assert torch.equal(unshard([o[0] for o in out], dst, mesh), x)
    if not dst.is_partial:
        for rank, d in enumerate(mesh.device_ids):
            assert torch.equal(out[rank][0], shard_tensor(x, dst, mesh, d))
    assert out.bytes_sent == [pytest.approx(cost.bytes, rel=1e-12, abs=0)] * mesh.size
    assert len(out.records[0]) == len(cost.collectives)


# ------------------------------------------------------------------------- ops in the IR

ALL_OPS_TEXT = """
mesh @mesh = <[2, 2]>
graph @every_op(
    %x: f32[4,8] input,
) on @mesh {
  %0 = all_reduce(%x) {axes=[0], n=2, op="sum"}               : f32[4,8]
  %1 = all_gather(%0) {axes=[1], n=2, dim=1}                  : f32[4,16]
  %2 = reduce_scatter(%1) {axes=[0, 1], n=4, dim=1, op="max"} : f32[4,4]
  %3 = all_to_all(%2) {axes=[1], n=2, split_dim=0, concat_dim=1} : f32[2,8]
  %4 = local_slice(%3) {axes=[0], n=2, dim=1}                 : f32[2,4]
  %5 = local_pad(%4) {axes=[1], n=2, dim=0}                   : f32[4,4]
  %6 = local_zero(%5) {axes=[0, 1], n=4, op="sum"}            : f32[4,4]
  %7 = all_reduce(%6) {axes=[0, 1], n=4, op="avg"}            : f32[4,4]
  %8 = send(%7) {dst=1, tag=3}                                : f32[4,4]
  %9 = recv() {src=3, shape=[4, 4], dtype="f32", tag=3}       : f32[4,4]
  return %8 output,
         %9 output
}
"""

# ... and the tile ops of a tensor crossing between two sub-meshes (ranks 4 and 5 are another
# stage's: a program that only type-checks here, run by tests/ir/test_cross_mesh.py)
EVERY_OP_TEXT = ALL_OPS_TEXT.replace("""  return %8 output,
         %9 output""", """  %10 = send_tiles(%9) {src=[0, 1], dst=[4, 5], dim=0, tag=1} : f32[4,4]
  %11 = recv_tile() {src=[4, 5], dst=[0, 1], shape=[2, 4], dtype="f32", tag=2} : f32[2,4]
  return %8 output,
         %10 output,
         %11 output""")


def test_ops_are_registered_typed_and_round_trip():
    g = parse(EVERY_OP_TEXT)
    verify(g)
    assert parse(print_graph(g)) == g
    for op in SPMD_OPS:
        assert get_op(op).kind.value == "collective"


def test_a_device_program_counts_flops_of_its_compute_only():
    """Communication is priced by bytes (cost.collectives); FLOPs counted for it too would
    charge it twice in the roofline and in the report's compute estimate: a matmul followed
    by every kind of collective costs exactly the matmul's 2·M·N·K."""
    body = EVERY_OP_TEXT.replace("    %x: f32[4,8] input,\n",
                                "    %a: f32[4,16] input,\n    %w: f32[16,8] param,\n")
    body = body.replace("{\n  %0 = all_reduce(%x)", "{\n  %x = matmul(%a, %w) : f32[4,8]\n"
                        "  %0 = all_reduce(%x)", 1)
    g = parse(body)
    verify(g)
    assert {n.op for n in g.nodes} == set(SPMD_OPS) | {"matmul"}
    assert sum(node_flops(n) for n in g.nodes) == 2 * 4 * 16 * 8
    assert [line for line in print_graph(g).splitlines() if "FLOP" in line] == [
        line for line in print_graph(g).splitlines() if "matmul" in line]


@pytest.mark.parametrize("line,message", [
    ("all_gather(%x) {axes=[1], n=2, dim=1} : f32[4,8]", "result types"),
    ("reduce_scatter(%x) {axes=[1], n=3, dim=1, op=\"sum\"} : f32[4,8]", "not divisible"),
    ("all_reduce(%x) {axes=[1, 0], n=4, op=\"sum\"} : f32[4,8]", "ascending"),
    ("all_reduce(%x) {axes=[0], n=2, op=\"prod\"} : f32[4,8]", "op must be one of"),
    ("all_to_all(%x) {axes=[0], n=2, split_dim=2, concat_dim=0} : f32[4,8]", "not a dim"),
    ("local_slice(%x) {axes=[0], dim=0} : f32[2,8]", "group size"),
])
def test_bad_attributes_fail_verification(line, message):
    g = parse(f"mesh @m = <[2, 2]>\ngraph @g(%x: f32[4,8] input) on @m {{\n  %0 = {line}\n"
              "  return %0 output\n}\n")
    with pytest.raises(VerificationError, match=message):
        verify(g)


def test_emit_step_maps_step_fields_to_attrs():
    g = Graph("g")
    v = g.add_input("x", TensorType((4, 8), torch.float32))
    a2a = Step(StepKind.ALL_TO_ALL, (1,), 4, 128.0, 96.0, 0.0, gather_dim=0, scatter_dim=1)
    out = emit_step(g, a2a, v)
    assert (out.producer.op, out.producer.attrs) == (
        "all_to_all", {"axes": (1,), "n": 4, "split_dim": 1, "concat_dim": 0})
    assert out.type.shape == (16, 2)
    rs = Step(StepKind.REDUCE_SCATTER, (0, 1), 8, 128.0, 112.0, 0.0, scatter_dim=1,
              reduce_op="max")
    first = g.nodes[0]
    out2 = emit_step(g, rs, v, before=first)
    assert g.nodes[0] is out2.producer
    assert out2.producer.attrs == {"axes": (0, 1), "n": 8, "dim": 1, "op": "max"}
    with pytest.raises(ValueError, match="no SPMD op"):
        emit_step(g, Step(StepKind.BROADCAST, (0,), 2, 1.0, 1.0, 0.0), v)


# ------------------------------------------------------------------------- without a communicator

def test_plain_reference_run_refuses_collectives_but_runs_groups_of_one():
    g = _one_op("all_reduce", (4,), {"axes": (0,), "n": 2, "op": "sum"}, Mesh((2,)))
    with pytest.raises(BackendError, match="needs the device's rank"):
        run(g, {"x": torch.ones(4)})
    single = _one_op("all_gather", (4,), {"axes": (0,), "n": 1, "dim": 0}, Mesh((1,)))
    assert torch.equal(run(single, {"x": torch.arange(4.0)})[0], torch.arange(4.0))
