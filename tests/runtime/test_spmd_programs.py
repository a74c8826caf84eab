"""Device programs in one process: a Megatron MLP against the global computation, layouts
split and joined, MPMD send/recv, and the errors of programs that cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphpar.cost.communication import all_reduce_cost
from graphpar.errors import BackendError, ShardingError
from graphpar.ir.layout import Layout, all_layouts
from graphpar.ir.mesh import Mesh
from graphpar.ir.parser import parse
from graphpar.runtime.spmd import (
    Communicator,
    run_spmd_in_process,
    shard_tensor,
    unshard,
)

# Megatron MLP on 2x2: batch over mesh axis 0, hidden over mesh axis 1. Global x [8,16]
# {S(0),R}, w1 [16,32] {R,S(1)} (column-parallel), w2 [32,16] {R,S(0)} (row-parallel).
MLP = """
mesh @mesh = <[2, 2]>
graph @megatron_mlp(
    %x: f32[4,16] input,
    %w1: f32[16,16] param,
    %w2: f32[16,16] param,
) on @mesh {
  %0 = matmul(%x, %w1)                                  : f32[4,16]
  %1 = gelu(%0)                                         : f32[4,16]
  %2 = matmul(%1, %w2)                                  : f32[4,16]
  %3 = all_reduce(%2) {axes=[1], n=2, op="sum"}         : f32[4,16]
  return %3 output
}
"""
MLP_LAYOUTS = {"x": "{S(0),R}", "w1": "{R,S(1)}", "w2": "{R,S(0)}"}


def mlp_case(seed: int = 0):
    """(global tensors, per-rank inputs, mesh, expected global output)."""
    mesh = Mesh((2, 2))
    g = torch.Generator().manual_seed(seed)
    tensors = {"x": torch.randn(8, 16, generator=g), "w1": torch.randn(16, 32, generator=g),
               "w2": torch.randn(32, 16, generator=g)}
    inputs = [{k: shard_tensor(t, Layout.parse(MLP_LAYOUTS[k]), mesh, d)
               for k, t in tensors.items()} for d in mesh.device_ids]
    expected = F.gelu(tensors["x"] @ tensors["w1"]) @ tensors["w2"]
    return tensors, inputs, mesh, expected


def test_megatron_mlp_in_process_equals_global_with_predicted_bytes():
    _, inputs, mesh, expected = mlp_case()
    out = run_spmd_in_process(parse(MLP), inputs)  # the mesh comes from its declaration
    result = unshard([o[0] for o in out], Layout.parse("{S(0),R}"), mesh)
    torch.testing.assert_close(result, expected)
    predicted = all_reduce_cost(4 * 16 * 4, mesh, 1).bytes_sent
    assert out.bytes_sent == [predicted] * 4
    assert out.bytes_by_node(0) == {3: predicted}
    rec = out.records[2][0]
    assert (rec.op, rec.axes, rec.group_size, rec.nbytes) == ("all_reduce", (1,), 2, 256.0)


@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 2)])
def test_shard_unshard_round_trips(shape):
    mesh = Mesh(shape)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    layouts = all_layouts(x.shape, mesh, include_partial=True) + [
        Layout.parse(t) for t in ("{P(max),S(0)}", "{P(avg),R}", "{S(1),P(min)}", "{P,P}")]
    for layout in layouts:
        local = [shard_tensor(x, layout, mesh, d) for d in mesh.device_ids]
        assert all(t.shape == layout.local_shape(x.shape, mesh) for t in local)
        back = unshard(local, layout, mesh)
        if layout.is_partial and any(p.is_partial() and p.reduce_op == "avg" for p in layout):
            torch.testing.assert_close(back, x)  # the mean of equal copies: last-bit rounding
        else:
            assert torch.equal(back, x), layout
        by_device = dict(zip(mesh.device_ids, local))
        assert torch.equal(unshard(by_device, layout, mesh), back)


def test_unshard_checks_replicas_and_completeness():
    mesh = Mesh((2, 2))
    x = torch.arange(16.0).reshape(4, 4)
    layout = Layout.parse("{S(0),R}")
    local = [shard_tensor(x, layout, mesh, d) for d in mesh.device_ids]
    local[1] = local[1] + 1  # device 1 should be a replica of device 0
    with pytest.raises(ShardingError, match="devices 0 and 1 hold the same slice"):
        unshard(local, layout, mesh)
    assert torch.equal(unshard(local, layout, mesh, check=False)[:2], x[:2])
    with pytest.raises(ShardingError, match="no local tensor for devices"):
        unshard({0: local[0]}, layout, mesh)


def test_sub_mesh_device_ids_and_group_order():
    """A mesh on devices 8..15: ranks are positions, groups follow Mesh.groups."""
    mesh = Mesh((2, 4), device_ids=tuple(range(8, 16)))
    comm = Communicator(mesh, 5)
    assert comm.device == 13 and comm.coordinate == (1, 1)
    assert comm.group(1) == (4, 5, 6, 7) and comm.group(0) == (1, 5)
    assert comm.group((0, 1)) == tuple(range(8)) and comm.position((0, 1)) == 5
    x = torch.arange(8.0)
    layout = Layout.parse("{S(0),S(0)}")
    assert torch.equal(shard_tensor(x, layout, mesh, 13), x[5:6])
    with pytest.raises(BackendError, match="cannot run all_reduce on its own"):
        comm.all_reduce(x, 1)


PIPE_SEND = """
mesh @mesh = <[2]>
graph @stage0(%x: f32[2,3] input) on @mesh {
  %0 = mul(%x, 2.0)                                      : f32[2,3]
  %1 = send(%0) {dst=1, tag=0}                           : f32[2,3]
  %2 = recv() {src=1, shape=[3], dtype="f32", tag=1}     : f32[3]
  return %1 output, %2 output
}
"""
PIPE_RECV = """
mesh @mesh = <[2]>
graph @stage1(%x: f32[2,3] input) on @mesh {
  %0 = recv() {src=0, shape=[2,3], dtype="f32", tag=0}   : f32[2,3]
  %1 = sum(%0) {dims=[0]}                                : f32[3]
  %2 = send(%1) {dst=0, tag=1}                           : f32[3]
  return %2 output
}
"""


def test_mpmd_send_recv_in_process():
    x = torch.arange(6.0).reshape(2, 3)
    out = run_spmd_in_process([PIPE_SEND, PIPE_RECV], [{"x": x}, {"x": torch.zeros(2, 3)}])
    assert torch.equal(out[1][0], (2 * x).sum(0))
    assert torch.equal(out[0][1], (2 * x).sum(0))
    assert out.bytes_sent == [24.0, 12.0]
    assert [(r.op, r.peer, r.bytes_sent) for r in out.records[1]] == [
        ("recv", 0, 0.0), ("send", 0, 12.0)]


def test_programs_that_cannot_run_raise_backend_error():
    x = {"x": torch.zeros(2, 3)}
    lonely = PIPE_RECV.replace("src=0", "src=1").replace("dst=0", "dst=1")
    with pytest.raises(BackendError, match="cannot make progress"):
        run_spmd_in_process([PIPE_SEND, PIPE_RECV.replace("tag=0", "tag=5")], [x, x])
    with pytest.raises(BackendError, match="not another rank"):
        run_spmd_in_process([PIPE_SEND, lonely], [x, x])
    ar = """
    mesh @mesh = <[2]>
    graph @g(%x: f32[4] input) on @mesh {
      %0 = all_reduce(%x) {axes=[0], n=2, op="OP"} : f32[4]
      return %0 output
    }
    """
    v = {"x": torch.ones(4)}
    with pytest.raises(BackendError, match="mismatched collectives"):
        run_spmd_in_process([ar.replace("OP", "sum"), ar.replace("OP", "max")], [v, v])
    with pytest.raises(BackendError, match="rank 0 waits at node 0"):
        run_spmd_in_process([ar.replace("OP", "sum"), PIPE_SEND.replace("dst=1", "dst=0")
                             .replace("src=1", "src=0")], [v, x])
    with pytest.raises(BackendError, match="program for mesh 2 but runs on mesh 4"):
        run_spmd_in_process(ar.replace("OP", "sum"), [v] * 4, "4")
    with pytest.raises(BackendError, match="n=2 but mesh 2x2 has 4 devices"):
        run_spmd_in_process(ar.replace("OP", "sum").replace("<[2]>", "<[2, 2]>")
                            .replace("axes=[0]", "axes=[0, 1]"), [v] * 4)
    with pytest.raises(BackendError, match="3 input sets given for a 2-rank mesh"):
        run_spmd_in_process(ar.replace("OP", "sum"), [v] * 3)
    reshard = ar.replace('all_reduce(%x) {axes=[0], n=2, op="OP"}', "reshard(%x)")
    with pytest.raises(BackendError, match="reshard node is left"):
        run_spmd_in_process(reshard, [v, v])
    with pytest.raises(BackendError, match=r"rank 1 \(device 1\) failed: .*expects f32\[4\]"):
        run_spmd_in_process(ar.replace("OP", "sum"), [v, {"x": torch.ones(5)}])
