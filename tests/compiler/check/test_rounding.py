"""The rounding model: PyTorch in float64, and float32-sized rounding errors drawn where float32
would round, so that each result's tolerance follows its own computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from graphpar.capture import Adam
from graphpar.compiler.check.eager import compare, eager_reference
from graphpar.compiler.check.rounding import UNIT, Float64, Rounding, float64_run
from graphpar.compiler.driver import ModelSpec
from graphpar.ir.graph import Output, OutputRole, Value
from graphpar.ir.types import TensorType


def test_float64_keeps_float64_where_code_asks_for_float32():
    x = torch.randn(4, dtype=torch.float64)
    with Float64():
        assert torch.ones(3, dtype=torch.float32).dtype == torch.float64
        assert x.float().dtype == torch.float64
        assert (x.float() == x).all()


def spread_of(fn, samples=16):
    exact = fn()
    draws = []
    for seed in range(samples):
        with Rounding(seed):
            draws.append(fn() - exact)
    return exact, torch.stack(draws).square().mean(0).sqrt()


def test_a_cancelling_sum_gets_the_rounding_of_its_terms():
    """1e4 + 1 - 1e4 is exactly 1 in float64 and small, but a float32 sum of its terms in
    another order is off by about u·1e4: the spread follows the terms, not the result."""
    x = torch.tensor([1e4, 1.0, -1e4], dtype=torch.float64)
    exact, spread = spread_of(lambda: x.sum())
    assert exact == 1.0
    assert UNIT * 1e3 < spread < UNIT * 1e5


def test_ops_that_do_not_round_are_left_alone():
    x = torch.randn(3, 4, dtype=torch.float64)

    def exact_ops():
        return torch.cat([x.relu(), x.t().reshape(3, 4), x[:, [1, 0, 2, 3]], x.amax(1, True)
                          .expand(3, 4)])
    _, spread = spread_of(exact_ops, samples=4)
    assert torch.equal(spread, torch.zeros_like(spread))


def test_a_matmul_gets_a_reduction_error_per_element():
    a, b = torch.randn(8, 64, dtype=torch.float64), torch.randn(64, 8, dtype=torch.float64)
    exact, spread = spread_of(lambda: a @ b)
    scale = UNIT * math.sqrt(64) * (a.abs() @ b.abs())
    assert (spread > 0).all()
    assert (spread < 2 * scale).all() and spread.mean() > 0.1 * scale.mean()


def test_seeded_draws_repeat():
    x = torch.randn(100, dtype=torch.float64)
    with Rounding(3):
        first = x.exp().sum()
    with Rounding(3):
        second = x.exp().sum()
    assert first == second


class KeyBiasAttention(torch.nn.Module):
    """One attention layer whose key projection has a bias: the bias's gradient is zero in
    exact arithmetic (softmax ignores a constant added to every score)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k,
                                                                             self.v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).sum()


def test_a_mathematically_zero_gradient_gets_the_tolerance_of_its_terms():
    torch.manual_seed(0)
    module, x = KeyBiasAttention(), torch.randn(2, 16, 32) * 4
    spec = ModelSpec("attn", module, (x,), lambda out: out)
    reference = eager_reference(spec, True, Adam(), steps=1)
    key = ("gradients", "k.bias")
    assert reference.values[0][key].abs().max() < 1e-12  # zero, up to float64 rounding
    # float32 eager PyTorch: its key-bias gradient is all rounding, yet within the bound
    module.zero_grad()
    module(x).backward()
    float32 = module.k.bias.grad
    assert float32.abs().max() > 0
    bound = reference.bound(0, key)
    assert (float32.double().abs() <= bound).all()
    # the bound is rounding-sized: a relative bug of 1e-4 in the value gradient is not
    outputs = [Output(Value(TensorType(tuple(p.shape), torch.float32)), OutputRole.GRAD, name)
               for name, p in module.named_parameters()]
    grads = [p.grad.clone() for p in module.parameters()]
    assert compare(outputs, [grads], reference_without_step(reference)).within_tolerance
    grads[-1] = grads[-1] * (1 + 1e-4)
    bad = compare(outputs, [grads], reference_without_step(reference))
    assert not bad.within_tolerance and bad.errors["gradients"].at == "v.bias"
    assert bad.tolerance_used > 5


def reference_without_step(reference):
    from graphpar.compiler.check.eager import Reference

    keep = [{k: v for k, v in s.items() if k[0] == "gradients"} for s in reference.values]
    spreads = [{k: v for k, v in s.items() if k[0] == "gradients"} for s in reference.spreads]
    return Reference(keep, spreads)


@pytest.mark.parametrize("seed", [None, 0])
def test_grouped_mm_runs_in_float64(seed):
    a = torch.randn(6, 4, dtype=torch.float64)
    b = torch.randn(3, 4, 5, dtype=torch.float64)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    with float64_run(seed):
        out = torch._grouped_mm(a, b, offs=offs)
    want = torch.cat([a[:2] @ b[0], a[2:6] @ b[2]])
    assert out.dtype == torch.float64
    assert torch.allclose(out, want, rtol=1e-5 if seed is not None else 1e-12)


def test_flash_attention_runs_as_its_math_form_with_grouped_heads():
    """The fused CPU attention kernels run as their math form (so their sums get rounding):
    in float64 it equals the kernels, forward and backward, with fewer key heads than query
    heads; under rounding its spread covers what float32 kernels do."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 8, 8, dtype=torch.float64), torch.randn(2, 2, 8, 8,
                                                                     dtype=torch.float64)
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    out, lse = forward(q, k, v, 0.0, True)[:2]
    grad = torch.randn_like(out)
    grads = backward(grad, q, k, v, out, lse, 0.0, True)
    with float64_run(None):
        assert all(torch.allclose(a, b, atol=1e-12)
                   for a, b in zip((out, lse), forward(q, k, v, 0.0, True)[:2]))
        assert all(torch.allclose(a, b, atol=1e-12)
                   for a, b in zip(grads, backward(grad, q, k, v, out, lse, 0.0, True)))
    _, spread = spread_of(lambda: forward(q, k, v, 0.0, True)[0], samples=8)
    float32 = forward(q.float(), k.float(), v.float(), 0.0, True)[0].double()
    assert ((float32 - out).abs() <= 8 * spread + UNIT * out.abs()).all()
