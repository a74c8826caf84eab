"""One message per stage boundary and peer: `pack`/`unpack` round-trip tensors of any dtype,
shape and strides exactly, and `send_boundary`/`post_boundary` move several tensors' tiles
between sub-meshes as one message per (sender, receiver) pair, recording the payload bytes;
the pipeline ranks post each receive one ahead per kind."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from graphpar.errors import BackendError
from graphpar.ir.cross_mesh import tile_transfer
from graphpar.ir.mesh import Mesh
from graphpar.ir.schedule import Action, ActionKind
from graphpar.ir.types import TensorType
from graphpar.runtime.comm import Communicator, pack, packed_offsets, unpack
from graphpar.runtime.pipeline import ReceivesAhead


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),  # the next one pads
        torch.randn(4, 6, generator=g).t(),  # not contiguous
        torch.tensor(2.5, dtype=torch.float64),  # 0-d
        torch.rand(2, 3, generator=g) > 0.5,  # bool
        torch.randint(-9, 9, (5,), dtype=torch.int64, generator=g),
        torch.randn(3, 1, generator=g).to(torch.bfloat16),
        torch.randn(2, 2, generator=g).half(),
        torch.empty(0, 4),  # no elements
    ]


def test_pack_and_unpack_round_trip_exactly():
    parts = tensors()
    types = [TensorType.of(t) for t in parts]
    buffer = pack(parts)
    offsets, size = packed_offsets(types)
    assert buffer.dtype == torch.uint8 and buffer.shape == (size,)
    payload = sum(ty.nbytes for ty in types)
    assert payload <= size < payload + 8 * len(types)
    # 3 bytes, padded to the f32's 4; its 96 bytes end at 100, padded to the f64's 104
    assert offsets[:3] == [0, 4, 104]
    assert all(o % ty.itemsize == 0 for o, ty in zip(offsets, types))
    back = unpack(buffer, types)
    for t, u in zip(parts, back):
        assert u.dtype == t.dtype and u.shape == t.shape
        assert torch.equal(u, t)
        # a view of the one buffer, not a copy
        assert u.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_a_buffer_of_other_tensors_is_refused():
    types = [TensorType.of(t) for t in tensors()]
    with pytest.raises(BackendError, match=r"flat uint8 buffer of \d+ bytes, got torch.uint8 "
                                           r"\(12,\): sender and receiver disagree"):
        unpack(torch.zeros(12, dtype=torch.uint8), types)


class MailboxCommunicator(Communicator):
    """A rank whose sends land in a shared mailbox, its receives read it (in this process)."""

    def __init__(self, mesh: Mesh, rank: int, box: dict) -> None:
        super().__init__(mesh, rank)
        self.box = box

    def _send(self, x, dst, tag):
        self.box.setdefault((self.global_rank, dst, tag), deque()).append(x.clone())

    def _recv(self, shape, dtype, src, tag):
        message = self.box[src, self.global_rank, tag].popleft()
        assert message.shape == shape and message.dtype == dtype
        return message


def test_a_boundary_crosses_as_one_message_per_pair_of_ranks():
    # two sending devices (ranks 0, 1) and three receiving ones (2, 3, 4): tile j of every
    # tensor goes from rank j mod 2 to rank 2 + j; a tensor no dimension of which 3 divides
    # goes whole to each receiving device
    box: dict = {}
    world = Mesh((5,), tuple(range(5)))
    comms = [MailboxCommunicator(world, r, box) for r in range(5)]
    g = torch.Generator().manual_seed(1)
    boundary = [torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g).t(),
                torch.arange(3), torch.rand(2, 2, generator=g) > 0.5]
    plans = [tile_transfer(TensorType.of(t), (0, 1), (2, 3, 4)) for t in boundary]
    assert [p.dim for p in plans] == [0, 0, 0, None]
    for rank in (0, 1):
        comms[rank].send_boundary(list(zip(boundary, plans)), tag=7)
    # one message per (sender, receiver) pair: 0 -> 2, 1 -> 3, 0 -> 4
    assert sorted((s, d) for s, d, _ in box) == [(0, 2), (0, 4), (1, 3)]
    assert all(len(queue) == 1 for queue in box.values())
    for j, rank in enumerate((2, 3, 4)):
        tiles = comms[rank].post_boundary(plans, tag=7).wait()
        for t, plan, tile in zip(boundary, plans, tiles):
            expected = t if plan.dim is None else torch.chunk(t, 3, plan.dim)[j]
            assert tile.dtype == t.dtype and torch.equal(tile, expected)
    assert not any(box.values())
    # the byte records are each tile's payload, as if sent alone: the plans' bytes across
    sent = sum(c.bytes_sent for c in comms)
    assert sent == sum(p.bytes_across for p in plans)
    assert [r.peer for r in comms[2].records] == [0] * 4  # one recv record per tile


def test_receives_are_posted_one_ahead_per_kind():
    # stage 1 of 3 under 1F1B-like order: forwards come from stage 0, gradients from stage 2
    F, B, RF, RB = ActionKind.F, ActionKind.B, ActionKind.RECV_F, ActionKind.RECV_B
    actions = [Action(k, 1, m) for k, m in [(RF, 0), (F, 0), (RF, 1), (F, 1), (RB, 0), (B, 0),
                                           (RF, 2), (F, 2), (RB, 1), (B, 1), (RB, 2), (B, 2)]]
    posted = []
    ahead = ReceivesAhead(actions, lambda a: posted.append(str(a)) or str(a))
    assert posted == ["RECV_F0", "RECV_B0"]  # the first of each kind, at once
    taken = [ahead.take(a) for a in actions if a.kind in (RF, RB)]
    assert taken == [str(a) for a in actions if a.kind in (RF, RB)]
    # each next one posted as the last of its kind is taken, before it is needed
    assert posted == ["RECV_F0", "RECV_B0", "RECV_F1", "RECV_F2", "RECV_B1", "RECV_B2"]
