"""How far float32 rounding can move a result: PyTorch run in float64, with and without modelled
rounding errors.

A compiled plan computes in float32 in another order than eager PyTorch does (sharded
reductions, other kernels), so its results differ from eager's by rounding. How much depends on
the computation, not on the result's size: the gradient of an attention key's bias is
mathematically zero (softmax ignores a constant added to every score), yet in float32 it is the
sum of large terms that cancel, so any two float32 computations of it differ by about
u·Σ|terms|, not by u·|result| = 0. This module gives the check (`check.eager`) both
what the exact result is and how far rounding can move each element of it:

- `Float64()` runs PyTorch code (a module's forward and backward, a torch.optim step, or
  graphpar's own IR interpreter) in float64: the reference, with rounding errors about 1e-16.
  Tensors the code asks for in float32 (`.float()`, `dtype=torch.float32`) are made float64
  too, so the reference stays exact.
- `Rounding(seed)` runs the same code in float64 with every rounding a float32 computation
  would do replaced by a random one of at most its size (Monte Carlo arithmetic, as in Parker's
  MCA and the CESTAC method): with u = 2**-24, the unit roundoff of float32, and r a fresh
  uniform draw in [-1, 1] per element,

      elementwise op        y -> y + r·u·|y|            (2u for exp, tanh, erf, ...: a libm
                                                         result is within about 1 ulp)
      reduction of K terms  y -> y + r·u·(|y| + √K·Σ|terms|)
          Σ|terms| is the same op on absolute values: |A|·|B| for a matmul, Σ|x| for a sum,
          conv(|x|, |w|) for a convolution. √K·u·Σ|terms| is the probabilistic bound on the
          error of summing K terms in any order (Higham and Mary, SIAM J. Sci. Comput. 41,
          2019): a sharded reduction is a sum in another order.
      a float scalar        c -> c·(1 + r·u)            (when c is not exact in float32, as
                                                         0.999 or 1e-8: each constant of a
                                                         float32 program is rounded on its own)

  Ops that do not round (copies, views, indexing, comparisons, max, relu, where) are left alone.
  Composite ops are first decomposed (softmax into exp, sum and div; layer norm into its mean
  and variance; ...) so that the sums inside them get their own errors, and attention runs as
  its math form.

The spread of a few such runs around the float64 result is the size of the rounding error at
each element, whatever the magnitudes involved: at the key bias's gradient it is the size of
the cancelling terms' rounding. `graphpar.compiler.check.eager` turns it into a tolerance.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch._decomp import decomposition_table
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["UNIT", "Float64", "Rounding", "float64_run", "to_float64"]

aten = torch.ops.aten

UNIT = 2.0 ** -24  # float32's unit roundoff: half the distance from 1 to the next float
# The relative error given to each probability of PyTorch's float32 CPU flash-attention kernels,
# which compute their exponentials faster and less exactly than libm: measured on random
# causal attention, their outputs reach 8.6 standard deviations of a model with
# correctly rounded exponentials, and 3 (a third of the bound) with this one.
KERNEL_EXP = 2.0 ** -21

# Composite ops run as their decompositions (every overload), so the reductions inside get their
# own rounding.
_DECOMPOSED_OPS = frozenset((
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward", "var_mean", "var", "std", "std_mean",
    "embedding_dense_backward", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
    "nll_loss2d_backward", "native_batch_norm", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "native_batch_norm_backward", "logsumexp", "linalg_vector_norm", "norm", "mse_loss",
    "mse_loss_backward", "native_group_norm", "native_group_norm_backward", "_fused_rms_norm",
    "huber_loss", "smooth_l1_loss", "binary_cross_entropy", "binary_cross_entropy_backward",
))

# Ops whose float32 result is exact: data movement, selection, comparisons, sign changes.
_EXACT = frozenset((
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "clone", "detach",
    "alias", "slice", "select", "unsqueeze", "squeeze", "cat", "stack", "split",
    "split_with_sizes", "unbind", "narrow", "diagonal", "as_strided", "contiguous", "flip",
    "roll", "repeat", "unfold", "tril", "triu", "constant_pad_nd", "index", "_unsafe_index",
    "index_select", "gather", "embedding", "where", "masked_fill", "masked_fill_", "copy_",
    "_to_copy", "lift_fresh", "lift_fresh_copy", "empty", "empty_like", "empty_strided", "zeros",
    "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros", "new_empty",
    "new_empty_strided", "new_full", "new_ones", "fill", "fill_", "zero_", "arange",
    "scalar_tensor", "lt", "gt", "le", "ge", "eq", "ne", "neg", "abs", "relu",
    "threshold_backward", "max", "amax", "min", "amin", "maximum", "minimum", "argmax", "argmin",
    "topk", "sort", "logical_not", "logical_and", "logical_or", "bitwise_not", "bitwise_and",
    "bitwise_or", "isnan", "isinf", "sign", "clamp", "clamp_min", "clamp_max", "select_backward",
    "slice_backward", "index_put", "index_put_", "_index_put_impl_", "set_", "any", "all",
    "_local_scalar_dense", "is_nonzero", "native_dropout", "native_dropout_backward",
    "select_scatter", "slice_scatter", "scatter", "max_pool2d_with_indices",
    "max_pool2d_with_indices_backward", "histc", "bincount", "cumsum_int", "floor", "ceil",
    "trunc", "round", "_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride",
    "sym_storage_offset", "resize_", "_reshape_alias", "view_as_real", "view_as_complex",
))

# Ops a float32 library computes to within about one ulp rather than correctly rounded.
_TRANSCENDENTAL = frozenset((
    "exp", "exp2", "log", "log2", "log10", "log1p", "expm1", "tanh", "erf", "erfc", "erfinv",
    "sigmoid", "sin", "cos", "tan", "atan", "atan2", "asin", "acos", "sinh", "cosh", "pow",
    "rsqrt", "gelu", "gelu_backward", "silu", "silu_backward", "softplus", "softplus_backward",
    "tanh_backward", "sigmoid_backward", "elu", "elu_backward", "mish", "lgamma", "digamma",
))


def to_float64(x):
    """`x` with float32 tensors made float64 (others as they are)."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        return x.double()
    return x


class Float64(TorchDispatchMode):
    """Run PyTorch code in float64 exactly as written: float32 asked for becomes float64
    (`dtype=torch.float32`, `.float()`), and ATen ops with no float64 kernel on the CPU
    (`_grouped_mm`) run as their plain form. Subclassed by `Rounding`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") == torch.float32:
            kwargs["dtype"] = torch.float64
        if func is aten._grouped_mm.default and args[0].dtype == torch.float64:
            with self:
                return _grouped_mm(*args, **kwargs)
        if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
            with self:  # as its math form, whose matmuls and softmax are visible
                return _flash_attention(self, *args, **kwargs)
        if func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            with self:
                return _flash_attention_backward(self, *args, **kwargs)
        return self.compute(func, args, kwargs)

    def compute(self, func, args, kwargs):
        return func(*args, **kwargs)


class Rounding(Float64):
    """`Float64` with a random rounding error of float32's size wherever float32 would round
    (see the module docstring); `seed` fixes the draws, `unit` is the unit roundoff."""

    def __init__(self, seed: int, unit: float = UNIT) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.unit = unit

    def compute(self, func, args, kwargs):
        name = func.overloadpacket.__name__
        if name in _DECOMPOSED_OPS and func in decomposition_table:
            with self:
                return decomposition_table[func](*args, **kwargs)
        if name in _EXACT:
            return func(*args, **kwargs)
        args = tuple(self._rounded_scalar(a) for a in args)
        kwargs = {k: self._rounded_scalar(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        unit = self.unit * (2 if name in _TRANSCENDENTAL else 1)
        if name == "convolution_backward":
            terms = _convolution_backward_terms(func, args, kwargs, out)
            return tuple(None if o is None else o + self._error(o, t, unit)
                         for o, t in zip(out, terms))
        terms = _terms(name, func, args, kwargs, out)
        return self._perturbed(func, args, out, terms, unit)

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        """Uniform draws in [-1, 1], one per element of `like`."""
        return torch.rand(like.shape, generator=self.generator, dtype=like.dtype) * 2 - 1

    def _rounded_scalar(self, a):
        if type(a) is float and math.isfinite(a) and float(torch.tensor(a).float()) != a:
            r = float(torch.rand((), generator=self.generator, dtype=torch.float64)) * 2 - 1
            return a * (1 + self.unit * r)
        if isinstance(a, (list, tuple)) and a and type(a[0]) is float:
            return type(a)(self._rounded_scalar(x) for x in a)
        return a

    def _error(self, y: torch.Tensor, terms: torch.Tensor | None, unit: float) -> torch.Tensor:
        size = y.abs() if terms is None else y.abs() + terms
        error = unit * self.draw(y) * size
        # masks and sentinels (-inf, finfo.min) are exact in any precision
        return torch.where(y.abs() < 1e200, torch.nan_to_num(error, 0.0, 0.0, 0.0), 0.0)

    def _perturbed(self, func, args, out, terms, unit):
        schema = func._schema
        if isinstance(out, torch.Tensor):
            if not out.is_floating_point():
                return out
            error = self._error(out, terms, unit)
            if any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
                return out.add_(error)  # an in-place op: its result is its first argument
            return out + error
        if isinstance(out, (tuple, list)):
            parts = [self._perturbed(func, args, o, None, unit) for o in out]
            return tuple(parts) if isinstance(out, tuple) else parts
        if out is None:  # in-place ops returning nothing (torch.optim's _foreach_*_)
            for value, arg in zip(args, schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    for t in value if isinstance(value, (list, tuple)) else [value]:
                        if isinstance(t, torch.Tensor) and t.is_floating_point():
                            t.add_(self._error(t, None, unit))
        return out


def _terms(name, func, args, kwargs, out) -> torch.Tensor | None:
    """√K·Σ|terms| of a reduction of K terms per element (module docstring); None otherwise."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    if name in ("mm", "bmm"):
        a, b = args[:2]
        return math.sqrt(a.shape[-1]) * func(a.abs(), b.abs())
    if name in ("addmm", "baddbmm"):
        c, a, b = args[:3]
        product = (torch.mm if name == "addmm" else torch.bmm)(a.abs(), b.abs())
        return math.sqrt(a.shape[-1] + 1) * (abs(kwargs.get("beta", 1)) * c.abs()
                                             + abs(kwargs.get("alpha", 1)) * product)
    if name in ("mv", "dot", "vdot"):
        a, b = args[:2]
        return math.sqrt(a.shape[-1]) * func(a.abs(), b.abs())
    if name in ("sum", "mean", "nansum", "cumsum"):
        x = args[0]
        if not x.is_floating_point():
            return None
        count = x.shape[args[1]] if name == "cumsum" else x.numel() // max(out.numel(), 1)
        return math.sqrt(max(count, 1)) * func(x.abs(), *args[1:], **kwargs)
    if name == "convolution":
        x, w, b = args[:3]
        terms = func(x.abs(), w.abs(), None if b is None else b.abs(), *args[3:], **kwargs)
        return math.sqrt(w[0].numel()) * terms
    if name in ("avg_pool2d", "_adaptive_avg_pool2d", "avg_pool2d_backward",
                "_adaptive_avg_pool2d_backward"):
        x = args[0]
        count = max(x.numel() // max(out.numel(), 1), out.numel() // max(x.numel(), 1), 1)
        return math.sqrt(count) * func(x.abs(), *args[1:], **kwargs)
    if name in ("index_add", "scatter_add", "scatter_reduce"):
        x, dim, index, src = args[:4]
        count = max(src.numel() // max(x.numel(), 1), 1)
        return math.sqrt(count) * func(x.abs(), dim, index, src.abs(), *args[4:], **kwargs)
    return None


def _convolution_backward_terms(func, args, kwargs, out):
    """√K·Σ|terms| of each of convolution_backward's results (input, weight, bias gradients):
    the same op on absolute values, K the terms each result element sums."""
    grad, x, w = args[:3]
    terms = func(grad.abs(), x.abs(), w.abs(), *args[3:], **kwargs)
    per_output = [w.shape[0] * w[0, 0].numel(),  # an input element: out channels x kernel
                  grad.numel() // max(grad.shape[1], 1),  # a weight element: batch x space
                  grad.numel() // max(grad.shape[1], 1)]  # a bias element: the same
    return [None if t is None else math.sqrt(max(k, 1)) * t for t, k in zip(terms, per_output)]


def _attention_scores(q, k, is_causal, attn_mask, scale):
    """q·kᵀ·scale with the causal and given masks (the math form of attention)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    return scores, scale


def _kernel_softmax(mode: Float64, scores: torch.Tensor) -> torch.Tensor:
    """softmax(scores), with the error of the float32 flash kernels' fast exponential
    (KERNEL_EXP of each probability) under `Rounding`."""
    p = torch.softmax(scores, -1)
    if isinstance(mode, Rounding):
        p = p * (1 + KERNEL_EXP * mode.draw(p))
    return p


def _grouped(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Keys or values with fewer heads than the queries (grouped-query attention) repeated so
    that query head h reads key head h // (q heads / kv heads), as SDPA's enable_gqa does."""
    groups = q.shape[-3] // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, -3)


def _ungrouped(grad: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The gradient of `_grouped(q, kv)` summed back onto kv's heads."""
    heads = kv.shape[-3]
    if grad.shape[-3] == heads:
        return grad
    return grad.unflatten(-3, (heads, grad.shape[-3] // heads)).sum(-3)


def _flash_attention(mode, q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None,
                     scale=None):
    """The CPU flash attention's (out, logsumexp) in its math form. (torch's decomposition of
    it returns the log-sum-exp unreduced.)"""
    k, v = _grouped(q, k), _grouped(q, v)
    scores, _ = _attention_scores(q, k, is_causal, attn_mask, scale)
    lse = torch.logsumexp(scores, -1)
    if isinstance(mode, Rounding):
        lse = lse + KERNEL_EXP * mode.draw(lse)
    return _kernel_softmax(mode, scores) @ v, lse


def _flash_attention_backward(mode, grad, q, k, v, out, lse, dropout_p=0.0, is_causal=False,
                              attn_mask=None, scale=None):
    """The CPU flash attention's backward in its math form, whose matmuls and softmax are
    visible: P = softmax(q·kᵀ·scale + mask), dV = Pᵀ·dO, dS = P ⊙ (dO·vᵀ - rowsum(P ⊙ dO·vᵀ)),
    dQ = dS·k·scale, dK = dSᵀ·q·scale."""
    k_heads, v_heads = k, v
    k, v = _grouped(q, k), _grouped(q, v)
    scores, scale = _attention_scores(q, k, is_causal, attn_mask, scale)
    p = _kernel_softmax(mode, scores)
    dp = grad @ v.transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    return ((ds @ k) * scale, _ungrouped((ds.transpose(-2, -1) @ q) * scale, k_heads),
            _ungrouped(p.transpose(-2, -1) @ grad, v_heads))


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """ATen's `_grouped_mm` as one mm per group (its CPU kernel takes no float64): a [S, K] by
    b [G, K, N] over row groups, a [K, S] by b [S, N] over contraction groups, or a batch."""
    if offs is None:
        out = torch.bmm(a, b)
    else:
        ends = offs.tolist()
        starts = [0, *ends[:-1]]
        if a.dim() == 2 and b.dim() == 3:
            out = a.new_zeros(a.shape[0], b.shape[2])
            for g, (s, e) in enumerate(zip(starts, ends)):
                if e > s:
                    out[s:e] = torch.mm(a[s:e], b[g])
        elif a.dim() == 2 and b.dim() == 2:
            out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
            for g, (s, e) in enumerate(zip(starts, ends)):
                if e > s:
                    out[g] = torch.mm(a[:, s:e], b[s:e])
        else:
            raise NotImplementedError(f"_grouped_mm of {a.dim()}-D by {b.dim()}-D in float64")
    return out if bias is None else out + bias


@contextlib.contextmanager
def float64_run(seed: int | None) -> Iterator[None]:
    """Run the block in float64 (`Float64`), with modelled float32 rounding when `seed` is not
    None (`Rounding(seed)`); attention runs as its math form, whose ops are visible."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mode = Float64() if seed is None else Rounding(seed)
    with sdpa_kernel([SDPBackend.MATH]), mode:
        yield
