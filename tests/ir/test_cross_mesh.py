"""A tensor crossing between sub-meshes as tiles (Alpa's local all-gather): which device sends
which tile to which, what crosses, and that the lockstep executor runs the tile ops."""

import pytest
import torch

from graphpar.cost.communication import cross_mesh_cost
from graphpar.ir.cross_mesh import stage_devices, tile_transfer
from graphpar.ir.mesh import Mesh
from graphpar.ir.parser import parse
from graphpar.ir.types import TensorType
from graphpar.runtime.spmd import run_spmd_in_process

F32 = torch.float32


def test_each_tile_crosses_once_from_the_sending_devices_in_turn():
    plan = tile_transfer(TensorType((2, 32, 64), F32), (0, 1), (2, 3, 4, 5))
    assert plan.dim == 1  # the first dim 4 divides
    assert plan.tile_type == TensorType((2, 8, 64), F32)
    assert plan.senders == (0, 1, 0, 1)
    assert plan.sent_by(1) == [(1, 3), (3, 5)]
    assert plan.source_of(4) == (2, 0)
    assert plan.gathered
    dst = Mesh((4,), (2, 3, 4, 5))
    assert plan.bytes_across == cross_mesh_cost(plan.type.nbytes, dst, 1.0, 0.0).bytes_across


def test_one_receiving_device_gets_the_tensor_whole_and_odd_sizes_go_whole_to_each():
    one = tile_transfer(TensorType((2, 8), F32), (0, 1), (2,))
    assert (one.dim, one.senders, one.tile_type, one.gathered) == (
        None, (0,), one.type, False)
    odd = tile_transfer(TensorType((2, 5), F32), (0,), (1, 2, 3))
    assert odd.dim is None and odd.bytes_across == 3 * odd.type.nbytes and not odd.gathered
    scalar = tile_transfer(TensorType((), F32), (0,), (1, 2))
    assert scalar.dim is None and scalar.tile_type == scalar.type
    with pytest.raises(ValueError, match="disjoint"):
        tile_transfer(TensorType((2,), F32), (0, 1), (1, 2))


def test_stage_devices_lay_sub_meshes_out_in_order():
    assert stage_devices(3, [1, 2, 4]) == [(0,), (1, 2), (3, 4, 5, 6)]
    assert stage_devices(2) == [(0,), (1,)]


# Rank 0 holds x whole and sends it as two tiles, the first to rank 1, the second to rank 2.
SENDER = """
mesh @mesh = <[3]>
graph @sender(%x: f32[4,3] input) on @mesh {
  %0 = send_tiles(%x) {src=[0, 0], dst=[1, 2], dim=0, tag=7} : f32[4,3]
  return %0 output
}
"""
RECEIVER = """
mesh @mesh = <[3]>
graph @receiver() on @mesh {
  %0 = recv_tile() {src=[0, 0], dst=[1, 2], shape=[2, 3], dtype="f32", tag=7} : f32[2,3]
  return %0 output
}
"""


def test_the_lockstep_executor_runs_tile_sends():
    x = torch.arange(12, dtype=F32).reshape(4, 3)
    sender, receiver = parse(SENDER), parse(RECEIVER)
    out = run_spmd_in_process([sender, receiver, receiver], [{"x": x}, {}, {}])
    assert torch.equal(out[1][0], x[:2]) and torch.equal(out[2][0], x[2:])
    assert out.bytes_sent == [x.nbytes, 0, 0]  # each byte once, by the sender
    assert [r.peer for r in out.records[0]] == [1, 2]


def test_a_tensor_no_dim_of_which_divides_goes_whole_to_each_receiver():
    x = torch.arange(6, dtype=F32).reshape(2, 3)
    sender = parse(SENDER.replace("f32[4,3]", "f32[2,3]").replace(" dim=0,", ""))
    receiver = parse(RECEIVER)
    out = run_spmd_in_process([sender, receiver, receiver], [{"x": x}, {}, {}])
    assert torch.equal(out[1][0], x) and torch.equal(out[2][0], x)
    assert out.bytes_sent == [2 * x.nbytes, 0, 0]
