"""attention_with_lse and attention_backward off CPU (a training rank on a GPU) compute what
the CPU flash-attention kernel does: their written-out form, run here on CPU tensors, equals
the kernel's outputs and gradients."""

import pytest
import torch

from graphpar.ir import ops


def _case(mask_kind):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    grad = torch.randn(2, 3, 5, 8, generator=g)
    mask = None
    if mask_kind == "float":
        mask = torch.randn(5, 5, generator=g)
    elif mask_kind == "bool":
        mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
        mask[..., 0] = True  # every query sees a key
    return q, k, v, grad, mask


@pytest.mark.parametrize("mask_kind, causal, scale", [
    (None, True, None), (None, False, 0.3), ("float", False, None), ("float", True, 0.5)])
def test_written_out_attention_equals_the_cpu_kernel(mask_kind, causal, scale):
    q, k, v, grad, mask = _case(mask_kind)
    out, lse = ops._attention_with_lse(q, k, v, mask, causal, scale)  # the CPU kernel
    mine_out, mine_lse = ops._math_attention_with_lse(q, k, v, mask, causal, scale)
    torch.testing.assert_close(mine_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine_lse, lse, rtol=1e-5, atol=1e-6)
    expected = ops._attention_backward(grad, q, k, v, out, lse, mask, causal, scale)
    mine = ops._math_attention_backward(grad, q, k, v, out, lse, mask, causal, scale)
    for name, a, b in zip(("dq", "dk", "dv"), mine, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_a_boolean_mask_keeps_what_scaled_dot_product_attention_keeps():
    """The CPU kernel takes only an additive mask; written out, a boolean one (True: attend)
    means what it means to F.scaled_dot_product_attention."""
    q, k, v, _, mask = _case("bool")
    out, _ = ops._math_attention_with_lse(q, k, v, mask, True, None)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask & torch.ones(5, 5, dtype=torch.bool).tril())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
