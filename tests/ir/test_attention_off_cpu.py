"""attention_with_lse and attention_backward off CPU (a training rank on a GPU) compute what
the CPU flash-attention kernel does: their written-out form, run here on CPU tensors, equals
the kernel's outputs and gradients."""

import pytest
import torch

from graphpar.ir import ops


def _case(mask_kind, kv_heads=3):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6 if kv_heads != 3 else 3, 5, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 5, 8, generator=g) for _ in range(2))
    grad = torch.randn(q.shape, generator=g)
    mask = None
    if mask_kind == "float":
        mask = torch.randn(5, 5, generator=g)
    elif mask_kind == "bool":
        mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
        mask[..., 0] = True  # every query sees a key
    return q, k, v, grad, mask


@pytest.mark.parametrize("mask_kind, causal, scale, kv_heads", [
    (None, True, None, 3), (None, False, 0.3, 3), ("float", False, None, 3),
    ("float", True, 0.5, 3), (None, True, None, 2)])  # the last: 6 query heads share 2 kv heads
def test_written_out_attention_equals_the_cpu_kernel(mask_kind, causal, scale, kv_heads):
    q, k, v, grad, mask = _case(mask_kind, kv_heads)
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
