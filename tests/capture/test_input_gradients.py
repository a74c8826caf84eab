"""A user input exported with requires_grad gets its gradient as a `grad` output naming the
input (token slicing differentiates the keys and values of earlier slices this way)."""

import torch
from torch import nn

from graphpar.capture import capture_training
from graphpar.ir.graph import OutputRole
from graphpar.ir.verify import verify


def test_a_user_input_that_requires_grad_gets_a_gradient_output():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    frozen = torch.randn(2, 3)  # no requires_grad: no gradient
    captured = capture_training(layer, (x,), lambda out, t: (out * t).sum(), (frozen,))
    verify(captured.graph)
    grads = {o.target: i for i, o in enumerate(captured.graph.outputs)
             if o.role is OutputRole.GRAD}
    assert set(grads) == {"weight", "bias", "input"}
    outputs = captured.run(x.detach(), frozen)
    (layer(x) * frozen).sum().backward()
    torch.testing.assert_close(outputs[grads["input"]], x.grad)
    torch.testing.assert_close(outputs[grads["weight"]], layer.weight.grad)
