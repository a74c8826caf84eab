"""Convolutions beyond 2-D: 1-D and 3-D, transposed, grouped and depthwise, as one IR op
(`convolution`) and its backward. Each kind's training step (loss and every gradient) equals
eager PyTorch, and every sharding strategy of its forward and backward convolutions, run on 2
ranks, gives the unsharded result."""

import pytest
import torch
from test_moe_ops import every_strategy_of

from graphpar.capture import capture_training
from graphpar.ir.graph import OutputRole

nn = torch.nn


def conv_kinds():
    """Each kind as a small module and its input: (module, x)."""
    return {
        "1d": (nn.Conv1d(4, 6, 3, stride=2, padding=1), (2, 4, 9)),
        "3d": (nn.Conv3d(2, 4, (2, 3, 3), padding=(0, 1, 1), dilation=(1, 2, 1)), (2, 2, 3, 6, 5)),
        "transposed_1d": (nn.ConvTranspose1d(4, 6, 4, stride=2, padding=1), (2, 4, 7)),
        "transposed_2d": (nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1),
                          (2, 4, 5, 5)),
        "grouped_1d": (nn.Conv1d(4, 8, 3, groups=2, padding=1), (2, 4, 8)),
        "depthwise_causal_1d": (nn.Conv1d(4, 4, 3, groups=4, padding=2), (2, 4, 8)),
        "depthwise_2d": (nn.Conv2d(4, 4, 3, groups=4, padding=1, bias=False), (2, 4, 6, 6)),
        "grouped_transposed_2d": (nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2), (2, 4, 3, 3)),
    }


def loss_of(out):
    return out.tanh().pow(2).sum()


# One default case per new kind (1-D, 3-D, transposed, grouped and depthwise); the rest slow.
SLOW = {"transposed_2d", "grouped_1d", "depthwise_2d"}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow if k in SLOW else ())
                                  for k in conv_kinds()])
def test_convolution_training_step_and_every_strategy_match_eager(kind):
    torch.manual_seed(0)
    module, shape = conv_kinds()[kind]
    x = torch.randn(*shape)
    captured = capture_training(module, (x,), loss_of)
    ops = [n.op for n in captured.graph.nodes]
    assert ops.count("convolution") == 1 and ops.count("convolution_backward") == 1
    loss = loss_of(module(x))
    loss.backward()
    params = dict(module.named_parameters())
    expected = [loss.detach() if o.role is OutputRole.LOSS else params[o.target].grad
                for o in captured.graph.outputs]
    outputs = captured.run(x)
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert every_strategy_of(captured, "convolution", (x,), expected) >= 3  # n, o and/or c
    assert every_strategy_of(captured, "convolution_backward", (x,), expected) >= 3


class Normalized(torch.nn.Module):
    """What speech and diffusion models wrap convolutions in: group norm (a layer norm over
    grouped channels; its backward torch's decomposition), a weight-normalized convolution
    (wav2vec2's positional one: a vector norm forward, weight normalization's own backward)
    and variance with mean."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 6))  # so x needs a gradient
        self.norm = torch.nn.GroupNorm(2, 4)
        self.conv = torch.nn.utils.parametrizations.weight_norm(
            torch.nn.Conv1d(4, 4, 3, padding=1, groups=2), dim=2)

    def forward(self, x):
        x = x * self.scale
        var, mean = torch.var_mean(x, dim=-1, keepdim=True)
        return self.conv(self.norm(x)) * var + mean


def test_group_norm_and_weight_normalized_convolution_match_eager():
    torch.manual_seed(0)
    module, x = Normalized(), torch.randn(2, 4, 6)
    captured = capture_training(module, (x,), loss_of)
    ops = {n.op for n in captured.graph.nodes}
    assert {"layer_norm_with_stats", "sqrt", "var"} <= ops
    loss = loss_of(module(x))
    loss.backward()
    params = dict(module.named_parameters())
    grads = {o.target: t for o, t in zip(captured.graph.outputs, captured.run(x))
             if o.role is OutputRole.GRAD}
    torch.testing.assert_close(captured.run(x)[0], loss.detach(), atol=1e-5, rtol=1e-5)
    assert set(grads) == set(params)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, params[name].grad, atol=1e-5, rtol=1e-5)
