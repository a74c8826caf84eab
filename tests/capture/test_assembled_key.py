"""A tensor assembled into an empty one by slice assignment, as DeepSeek-V3 builds its keys
(`new_empty`, then `key[..., :n] = ...`): its training step captures (autograd makes the
gradient's buffer with `aten.new_empty_strided`) and equals eager autograd."""

import torch
from torch import nn

from graphpar.capture import capture_training
from graphpar.ir.graph import OutputRole


class AssembledKey(nn.Module):
    def __init__(self):
        super().__init__()
        self.nope = nn.Linear(4, 3)
        self.rope = nn.Linear(4, 2)

    def forward(self, x):
        rope = self.rope(x)[:, None].expand(-1, 2, -1, -1)  # shared by 2 heads
        key = rope.new_empty(*rope.shape[:-1], 5)
        key[..., :3] = self.nope(x)[:, None]
        key[..., 3:] = rope
        return key


def test_a_key_assembled_into_an_empty_tensor_trains_equal_to_eager():
    torch.manual_seed(0)
    module, x = AssembledKey(), torch.randn(2, 6, 4)
    captured = capture_training(module, [x], lambda out: out.pow(2).mean(), [])
    outputs = captured.run(x)
    module(x).pow(2).mean().backward()
    grads = {o.target: t for o, t in zip(captured.graph.outputs, outputs)
             if o.role is OutputRole.GRAD}
    params = dict(module.named_parameters())
    assert set(grads) == set(params)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, params[name].grad)
