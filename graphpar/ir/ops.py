"""The core op set, at the level of PyTorch's core ATen decomposition plus composites.

Each op is one `_op` entry in `OPS`, which `graphpar.ir.load_ops` registers. A reference is the
torch computation the CPU executor runs, and by default also the op's type rule (run on meta
tensors). Attributes are plain data: dims and shapes as tuples, dtypes by IR name ("f32").
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from graphpar.ir.registry import (
    OpDef,
    OpKind,
    Trait,
    all_ops,
    get_op,
    infer_types,
    matmul_flops,
)
from graphpar.ir.registry import dtype as torch_dtype
from graphpar.ir.types import TensorType

__all__ = ["OPS", "OpDef", "OpKind", "Trait", "all_ops", "get_op", "infer_types"]

aten = torch.ops.aten
E, R, S, C, X, IX = (OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.SHAPE, OpKind.COMPOSITE,
                     OpKind.CREATION, OpKind.INDEXING)
SHAPE_ATTR, KEEPS_UNIFORM = Trait.SHAPE_ATTR, Trait.KEEPS_UNIFORM
CHEAP = (Trait.FOLLOWS_OPERAND,)  # a composite cheap enough to follow its operand's layout
REPLICATED = (Trait.REPLICATE_ONLY,)  # no sharding rule: auto-shard runs it replicated

OPS: list[OpDef] = []
"""This dialect's ops, in declaration order."""

# Cheap families take their layout from the operand they read (Alpa merges them into it).
_FOLLOWING_KINDS = (E, R, S)


def _op(name, kind, reference, doc="", traits=(), **kw):
    follows = {Trait.FOLLOWS_OPERAND} if kind in _FOLLOWING_KINDS else set()
    OPS.append(OpDef(name, kind, reference, doc=doc, traits=frozenset(follows | set(traits)),
                     **kw))


# --- elementwise ------------------------------------------------------------------------------

_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log,
    "log1p": torch.log1p, "expm1": torch.expm1, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "relu": torch.relu, "silu": F.silu, "erf": torch.erf, "reciprocal": torch.reciprocal,
    "sign": torch.sign, "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc,
    "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not, "isnan": torch.isnan,
}
# Transcendental functions count TRANSCENDENTAL FLOPs per element (`OpDef.flops_per_element`),
# so that one elementwise rate prices them beside adds.
TRANSCENDENTAL = 10
_TRANSCENDENTAL = {"exp", "log", "log1p", "expm1", "sin", "cos", "tanh", "sigmoid", "silu",
                   "erf"}
for _name, _fn in _UNARY.items():
    _op(_name, E, _fn, aten=_name,
        flops_per_element=TRANSCENDENTAL if _name in _TRANSCENDENTAL else 1)

_op("gelu", E, lambda x, approximate="none": F.gelu(x, approximate=approximate),
    flops_per_element=TRANSCENDENTAL)

# Binary ops take tensors or inline scalars on either side, with torch's type promotion.
_BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "pow": operator.pow,
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge, "bitwise_and": operator.and_,
    "bitwise_or": operator.or_, "bitwise_xor": operator.xor, "remainder": operator.mod,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or,
}
# add/sub carry ATen's alpha and pow takes a scalar base: capture lowers those three by hand.
_BY_HAND = ("add", "sub", "pow")
for _name, _fn in _BINARY.items():
    _op(_name, E, _fn, aten=None if _name in _BY_HAND else _name)


def _div(a, b, rounding_mode=None):
    if rounding_mode is None:
        return a / b
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(b, a)
    return torch.div(a, b, rounding_mode=rounding_mode)


_op("div", E, _div)
_op("where", E, torch.where, "where(cond, a, b): a where cond holds, else b")
_op("clamp", E, lambda x, min=None, max=None: torch.clamp(x, min, max))
_op("convert", E, lambda x, dtype: x.to(dtype=torch_dtype(dtype)),
    "convert(x) {dtype}: cast elementwise")

# Backward forms of activations, as autograd emits them.
_op("gelu_backward", E, lambda g, x, approximate="none": aten.gelu_backward(g, x,
                                                                             approximate=approximate),
    flops_per_element=TRANSCENDENTAL)  # an erf and an exp
_op("silu_backward", E, aten.silu_backward, flops_per_element=TRANSCENDENTAL)  # a sigmoid
_op("sigmoid_backward", E, aten.sigmoid_backward)
_op("tanh_backward", E, aten.tanh_backward)
_op("threshold_backward", E, lambda g, x, threshold: aten.threshold_backward(g, x, threshold))


# --- reductions -------------------------------------------------------------------------------

def _reduce(fn):
    def reference(x, dims=None, keepdim=False, dtype=None):
        kw = {} if dtype is None else {"dtype": torch_dtype(dtype)}
        return fn(x, dims if dims is not None else list(range(x.dim())), keepdim, **kw)
    return reference


_op("sum", R, _reduce(lambda x, d, k, **kw: torch.sum(x, d, k, **kw)))
_op("mean", R, _reduce(lambda x, d, k, **kw: torch.mean(x, d, k, **kw)))
_op("amax", R, _reduce(torch.amax))
_op("amin", R, _reduce(torch.amin))
_op("prod", R, lambda x, dim, keepdim=False: torch.prod(x, dim, keepdim))
_op("any", R, _reduce(lambda x, d, k: torch.any(x, d, k)))
_op("all", R, _reduce(lambda x, d, k: torch.all(x, d, k)))
_op("var", R, lambda x, dims, correction=1, keepdim=False: torch.var(x, dims,
                                                                      correction=correction,
                                                                      keepdim=keepdim))
_op("argmax", R, lambda x, dim, keepdim=False: torch.argmax(x, dim, keepdim))
_op("argmin", R, lambda x, dim, keepdim=False: torch.argmin(x, dim, keepdim))
_op("cumsum", R, lambda x, dim, dtype=None: torch.cumsum(x, dim, dtype=torch_dtype(dtype)))
_op("topk", R, lambda x, k, dim=-1, largest=True, sorted=True: tuple(
    torch.topk(x, k, dim, largest, sorted)), num_outputs=2)
_op("sort", R, lambda x, dim=-1, descending=False: tuple(torch.sort(x, dim=dim,
                                                                     descending=descending)),
    num_outputs=2)


# --- matmul -----------------------------------------------------------------------------------

_op("matmul", OpKind.MATMUL, torch.matmul, "matmul(a, b): batched a @ b, batch dims broadcast",
    flop_rule=matmul_flops)


def _linear_flops(operands, results, attrs):
    bias = results[0].numel if operands[2] is not None else 0
    return matmul_flops(operands, results, attrs) + bias


_op("linear", OpKind.MATMUL, lambda x, w, b=None: F.linear(x, w, b),
    "linear(x, w, b): x @ w.T + b, as nn.Linear", flop_rule=_linear_flops)


# --- shape and data movement ------------------------------------------------------------------
# Views (reshape, permute, expand, slice, select) move no data: free. The ops that write a new
# tensor (cat, pad, clone, the scatters, flip, tril/triu, repeat) stream their operands and
# result through memory like an elementwise op: `COPIES` prices them by those bytes (appending
# to a KV cache with `cat` copies the whole cache).
COPIES = {"cost_class": "elementwise"}

_op("reshape", S, lambda x, shape: x.reshape(shape), traits=(SHAPE_ATTR, KEEPS_UNIFORM))
_op("permute", S, lambda x, dims: x.permute(dims), traits=(KEEPS_UNIFORM,))
_op("expand", S, lambda x, shape: x.expand(shape), traits=(SHAPE_ATTR, KEEPS_UNIFORM))
_op("slice", S, lambda x, dim, start, end, step=1: aten.slice.Tensor(x, dim, start, end, step),
    traits=(KEEPS_UNIFORM,))
_op("select", S, lambda x, dim, index: x.select(dim, index), traits=(KEEPS_UNIFORM,))
_op("slice_scatter", S, lambda x, src, dim, start, end, step=1: torch.slice_scatter(
    x, src, dim, start, end, step), "slice_scatter(x, src) {dim, start, end, step}: x with the "
    "slice replaced by src", **COPIES)
_op("select_scatter", S, lambda x, src, dim, index: torch.select_scatter(x, src, dim, index),
    "select_scatter(x, src) {dim, index}", **COPIES)
_op("cat", S, lambda *xs, dim: torch.cat(xs, dim), "cat(x0, x1, ...) {dim}",
    traits=(KEEPS_UNIFORM,), **COPIES)
_op("pad", S, lambda x, pad, value=0.0: F.pad(x, pad, value=value),
    "pad(x) {pad, value}: constant padding, pairs from the last dim backwards", **COPIES)
_op("flip", S, lambda x, dims: torch.flip(x, dims), traits=(KEEPS_UNIFORM,), **COPIES)
_op("tril", S, lambda x, diagonal=0: torch.tril(x, diagonal), **COPIES)
_op("triu", S, lambda x, diagonal=0: torch.triu(x, diagonal), **COPIES)
_op("repeat", S, lambda x, repeats: x.repeat(repeats), traits=(KEEPS_UNIFORM,), **COPIES)
_op("clone", S, torch.clone, "clone(x): a copy; canonicalize drops it", traits=(KEEPS_UNIFORM,),
    **COPIES)
_op("reshard", OpKind.COLLECTIVE, lambda x: x,
    "reshard(x): x in the layout its result carries; lower-spmd makes it collectives",
    traits=REPLICATED)


# --- indexing ---------------------------------------------------------------------------------

def _index_list(x, indices, dims):
    full = [None] * (max(dims) + 1)
    for d, idx in zip(dims, indices):
        full[d] = idx
    return full


def _index(x, *indices, dims):
    return aten.index.Tensor(x, _index_list(x, indices, dims))


def _index_put(x, values, *indices, dims, accumulate=False):
    return aten.index_put(x, _index_list(x, indices, dims), values, accumulate)


def _gathered_bytes(operands, results, attrs) -> int:
    """A gather reads only the rows it picks: the indices, plus each result read and written,
    not the whole table it picks from (the first operand)."""
    indices = sum(t.nbytes for t in operands[1:] if isinstance(t, TensorType))
    return indices + 2 * sum(r.nbytes for r in results)


_op("index_select", IX, lambda x, idx, dim: torch.index_select(x, dim, idx), traits=REPLICATED,
    bytes_rule=_gathered_bytes)
_op("index", IX, _index,
    "index(x, i0, i1, ...) {dims}: advanced indexing, index tensor i_k at dim dims[k]",
    traits=REPLICATED, bytes_rule=_gathered_bytes)
_op("index_put", IX, _index_put,
    "index_put(x, v, i0, ...) {dims, accumulate}: functional x[i0, ...] = v (or += v)",
    traits=REPLICATED)
_op("gather", IX, lambda x, idx, dim: torch.gather(x, dim, idx), traits=REPLICATED,
    bytes_rule=_gathered_bytes)
_op("scatter_add", IX, lambda x, idx, src, dim: torch.scatter_add(x, dim, idx, src),
    traits=REPLICATED)
_op("scatter", IX, lambda x, idx, src, dim: torch.scatter(x, dim, idx, src), traits=REPLICATED)
_op("index_add", IX, lambda x, idx, src, dim: torch.index_add(x, dim, idx, src),
    "index_add(x, idx, src) {dim}: x with src[i] added at x[idx[i]] along dim (repeats add up)")
_op("histc", IX, lambda x, bins, min, max: torch.histc(x, bins, min, max),
    "histc(x) {bins, min, max}: counts of x in `bins` equal bins over [min, max] (float "
    "result); how MoE layers count the tokens routed to each expert",
    traits=REPLICATED)  # the counts depend on every element's value: one whole histogram


# --- mixture of experts -----------------------------------------------------------------------

def _grouped_mm(a, b, starts, ends):
    """Rows starts[e]:ends[e] of a times b[e] (a [S, K], b [E, K, N] -> [S, N]); or, with b
    2-D, column group e of a times row group e of b (a [K, S], b [S, N] -> [E, K, N]). Rows
    (or products) of no group are zero."""
    bounds = zip(starts.tolist(), ends.tolist())
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e, (start, end) in enumerate(bounds):
            if end > start:
                out[start:end] = a[start:end] @ b[e]
    else:
        out = a.new_zeros(starts.shape[0], a.shape[0], b.shape[1])
        for e, (start, end) in enumerate(bounds):
            if end > start:
                out[e] = a[:, start:end] @ b[start:end]
    return out


def _grouped_mm_type(operands, attrs):
    a, b, starts = operands[0], operands[1], operands[2]
    if a.rank != 2 or b.rank not in (2, 3) or starts.rank != 1 or operands[3].shape != starts.shape:
        raise TypeError(f"grouped_mm takes a 2-D a, a 2-D or 3-D b and two 1-D bounds, got "
                        f"{a}, {b}, {starts}, {operands[3]}")
    if b.rank == 3:
        if (b.shape[0], b.shape[1]) != (starts.shape[0], a.shape[1]):
            raise TypeError(f"grouped_mm: {a} and {b} with {starts.shape[0]} groups do not fit")
        return [TensorType((a.shape[0], b.shape[2]), a.dtype)]
    if a.shape[1] != b.shape[0]:
        raise TypeError(f"grouped_mm: {a} and {b} do not share their grouped dim")
    return [TensorType((starts.shape[0], a.shape[0], b.shape[1]), a.dtype)]


def _grouped_mm_flops(operands, results, attrs):
    """Every row (or contraction index) is in at most one group: one dense product's work."""
    a, b = operands[0], operands[1]
    return 2 * a.numel * b.shape[-1]


_op("grouped_mm", OpKind.MATMUL, _grouped_mm,
    "grouped_mm(a, b, starts, ends): one matmul per expert over its rows starts[e]:ends[e] of "
    "a (b [E, K, N]), or the per-expert weight gradient (b 2-D -> [E, K, N]); as ATen's "
    "_grouped_mm with offsets, each group's start explicit so experts can be split",
    type_rule=_grouped_mm_type, flop_rule=_grouped_mm_flops)


# --- creation ---------------------------------------------------------------------------------

def _creation(shape_of):
    def rule(operands, attrs):
        return [TensorType(shape_of(attrs), torch_dtype(attrs["dtype"]))]
    return rule


_op("full", X, lambda shape, value, dtype: torch.full(shape, value,
                                                      dtype=torch_dtype(dtype)),
    "full() {shape, value, dtype}", type_rule=_creation(lambda a: a["shape"]), traits=(SHAPE_ATTR,))
_op("arange", X, lambda start, end, step, dtype: torch.arange(start, end, step,
                                                              dtype=torch_dtype(dtype)),
    "arange() {start, end, step, dtype}",
    type_rule=_creation(lambda a: (math.ceil((a["end"] - a["start"]) / a["step"]),)),
    traits=REPLICATED)


# --- composites -------------------------------------------------------------------------------

def _attention_flops(operands, results, attrs):
    q, k = operands[0], operands[1]
    *batch, sq, d = q.shape
    sk = k.shape[-2]
    dv = operands[2].shape[-1]
    full = 2 * math.prod(batch) * sq * sk * (d + dv)
    return full // 2 if attrs.get("causal") else full


def _attention(q, k, v, mask=None, causal=False, scale=None, gqa=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=gqa)


_KERNEL_DEVICES = ("cpu", "meta")  # where the CPU flash kernel runs (meta: capture's shapes)


def _attention_with_lse(q, k, v, mask=None, causal=False, scale=None):
    if q.device.type not in _KERNEL_DEVICES:
        return _math_attention_with_lse(q, k, v, mask, causal, scale)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse


def _attention_backward(grad, q, k, v, out, lse, mask=None, causal=False, scale=None):
    if q.device.type not in _KERNEL_DEVICES:
        return _math_attention_backward(grad, q, k, v, out, lse, mask, causal, scale)
    return tuple(aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale))


# The CPU flash-attention kernel has no CUDA form (a training rank on a GPU runs the same IR):
# elsewhere the same results, written out in float32: out, and the log-sum-exp [batch, heads,
# seq_q] of the scaled, masked scores that the backward recomputes the probabilities from.

def _kv_heads(q, t):
    """k or v with its heads repeated to q's (grouped-query attention: the CPU kernel takes
    fewer key/value heads, each shared by heads // kv_heads query heads)."""
    return t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) if t.shape[-3] != q.shape[
        -3] else t


def _kv_grad(t, g):
    """The gradient of the repeated k or v summed back onto its own heads."""
    if t.shape[-3] == g.shape[-3]:
        return g
    groups = g.shape[-3] // t.shape[-3]
    return g.unflatten(-3, (t.shape[-3], groups)).sum(-3)


def _scores(q, k, mask, causal, scale):
    k = _kv_heads(q, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if causal:  # top-left aligned, as scaled_dot_product_attention's is_causal
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s, scale


def _math_attention_with_lse(q, k, v, mask, causal, scale):
    s, _ = _scores(q, k, mask, causal, scale)
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ _kv_heads(q, v).float()
    return out.to(q.dtype), lse


def _math_attention_backward(grad, q, k, v, out, lse, mask, causal, scale):
    s, scale = _scores(q, k, mask, causal, scale)
    p = torch.exp(s - lse.unsqueeze(-1))
    g = grad.float()
    k_all, v_all = _kv_heads(q, k).float(), _kv_heads(q, v).float()
    dv = _kv_grad(v, p.transpose(-2, -1) @ g)
    ds = p * (g @ v_all.transpose(-2, -1) - (g * out.float()).sum(-1, keepdim=True))
    dq = (ds @ k_all) * scale
    dk = _kv_grad(k, (ds.transpose(-2, -1) @ q.float()) * scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_op("attention", C, _attention,
    "attention(q, k, v, mask?) {causal, scale, gqa}: softmax(q k^T * scale + mask) v over "
    "[batch, heads, seq, head_dim]; gqa lets k/v have fewer heads", flop_rule=_attention_flops,
    cost_class="attention")
_op("attention_with_lse", C, _attention_with_lse,
    "attention that also returns the log-sum-exp the backward needs (training graphs)",
    num_outputs=2, flop_rule=_attention_flops, cost_class="attention")
_op("attention_backward", C, _attention_backward,
    "attention_backward(grad, q, k, v, out, lse, mask?) -> dq, dk, dv", num_outputs=3,
    flop_rule=lambda o, r, a: 2 * _attention_flops(o[1:], r, a), cost_class="attention")


def _norm_flops(operands, results, attrs):
    return 8 * results[0].numel


_op("layer_norm", C, lambda x, w=None, b=None, shape=None, eps=1e-5: F.layer_norm(
    x, shape, w, b, eps), "layer_norm(x, w?, b?) {shape, eps}", flop_rule=_norm_flops, traits=CHEAP,
    cost_class="normalization")
_op("layer_norm_with_stats", C, lambda x, w=None, b=None, shape=None, eps=1e-5: tuple(
    aten.native_layer_norm(x, shape, w, b, eps)),
    "layer_norm that also returns mean and rstd for the backward", num_outputs=3,
    flop_rule=_norm_flops, traits=CHEAP, cost_class="normalization")


def _layer_norm_backward(g, x, mean, rstd, w=None, b=None, shape=None, mask=(True, True, True)):
    return tuple(r for r in aten.native_layer_norm_backward(g, x, shape, mean, rstd, w, b, mask)
                 if r is not None)


_op("layer_norm_backward", C, _layer_norm_backward,
    "layer_norm_backward(grad, x, mean, rstd, w?, b?) {shape, mask} -> the grads mask asks for",
    num_outputs=None, flop_rule=lambda o, r, a: 2 * _norm_flops(o, r, a), traits=CHEAP,
    cost_class="normalization")
_op("rms_norm", C, lambda x, w=None, shape=None, eps=None: F.rms_norm(x, shape, w, eps),
    "rms_norm(x, w?) {shape, eps}", flop_rule=_norm_flops, traits=CHEAP, cost_class="normalization")
_op("softmax", C, lambda x, dim: torch.softmax(x, dim), flop_rule=lambda o, r, a: 5 * r[0].numel,
    traits=CHEAP, cost_class="normalization")
_op("log_softmax", C, lambda x, dim: torch.log_softmax(x, dim),
    flop_rule=lambda o, r, a: 5 * r[0].numel, traits=CHEAP, cost_class="normalization")
_op("softmax_backward", C, lambda g, y, dim: aten._softmax_backward_data(g, y, dim, y.dtype),
    flop_rule=lambda o, r, a: 3 * r[0].numel, traits=CHEAP, cost_class="normalization")
_op("log_softmax_backward", C,
    lambda g, y, dim: aten._log_softmax_backward_data(g, y, dim, y.dtype),
    flop_rule=lambda o, r, a: 3 * r[0].numel, traits=CHEAP, cost_class="normalization")
_op("embedding", C, lambda w, idx: F.embedding(idx, w), "embedding(weight, indices)",
    bytes_rule=_gathered_bytes,
    cost_class="gather")
_op("embedding_backward", C, lambda g, idx, num_weights, padding_idx=-1:
    aten.embedding_dense_backward(g, idx, num_weights, padding_idx, False),
    "embedding_backward(grad, indices) {num_weights, padding_idx}: dense weight gradient",
    cost_class="gather")


def _conv_flops(operands, results, attrs):
    """2·(elements on the wide side)·(inputs each one sums): the output for a convolution, the
    input for a transposed one (each input element scatters into C_out/groups·kernel)."""
    x, w = operands[0], operands[1]
    wide = x if attrs.get("transposed", False) else results[0]
    return 2 * wide.numel * math.prod(w.shape[1:])


def _conv_backward_flops(operands, results, attrs):
    """Twice the forward's: dx and dw are each one forward's work (counted from grad)."""
    g, x, w = operands[:3]
    wide = x if attrs.get("transposed", False) else g
    return 4 * wide.numel * math.prod(w.shape[1:])


def _convolution(x, w, b=None, stride=(1,), padding=(0,), dilation=(1,), groups=1,
                 transposed=False, output_padding=None):
    spatial = w.dim() - 2
    output_padding = output_padding if output_padding is not None else (0,) * spatial
    return aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding,
                            groups)


def _convolution_backward(g, x, w, stride=(1,), padding=(0,), dilation=(1,), groups=1,
                          bias=True, mask=(True, True, True), transposed=False,
                          output_padding=None):
    spatial = w.dim() - 2
    output_padding = output_padding if output_padding is not None else (0,) * spatial
    bias_sizes = [g.shape[1]] if bias else None
    grads = aten.convolution_backward(g, x, w, bias_sizes, stride, padding, dilation, transposed,
                                      output_padding, groups, mask)
    return tuple(r for r in grads if r is not None)


def _conv_local_attrs(attrs, global_types, local_types):
    """A shard of a grouped convolution holds a block of its groups: as many fewer groups as
    it holds fewer input channels (the rule splits channels only by whole groups)."""
    groups = attrs.get("groups", 1)
    x_global, x_local = global_types[0], local_types[0]
    if groups == 1 or x_global.shape[1] == x_local.shape[1]:
        return attrs
    return {**attrs, "groups": groups * x_local.shape[1] // x_global.shape[1]}


# One convolution for 1-, 2- and 3-D, plain or transposed (its spatial rank is the weight's
# minus two), as ATen's `convolution`; attributes `transposed` and `output_padding` appear only
# on transposed ones.
_op("convolution", C, _convolution,
    "convolution(x, w, b?) {stride, padding, dilation, groups, transposed?, output_padding?}",
    flop_rule=_conv_flops, cost_class="gemm", local_attrs=_conv_local_attrs)
_op("convolution_backward", C, _convolution_backward,
    "convolution_backward(grad, x, w) {stride, padding, dilation, groups, bias, mask,"
    " transposed?, output_padding?} -> dx, dw, db",
    num_outputs=None, flop_rule=_conv_backward_flops, cost_class="gemm",
    local_attrs=lambda attrs, g, local: _conv_local_attrs(attrs, g[1:], local[1:]))


def _max_pool2d(x, kernel, stride, padding, dilation, ceil_mode=False):
    return tuple(aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode))


_op("max_pool2d", C, _max_pool2d,
    "max_pool2d(x) {kernel, stride, padding, dilation, ceil_mode} -> values, indices",
    num_outputs=2, flop_rule=lambda o, r, a: r[0].numel * a["kernel"][0] * a["kernel"][1],
    cost_class="elementwise")
_op("max_pool2d_backward", C, lambda g, x, idx, kernel, stride, padding, dilation,
    ceil_mode=False: aten.max_pool2d_with_indices_backward(g, x, kernel, stride, padding,
                                                           dilation, ceil_mode, idx),
    "max_pool2d_backward(grad, x, indices) {kernel, stride, padding, dilation, ceil_mode}",
    cost_class="elementwise")


def _batch_norm(x, w, b, mean, var, training, momentum, eps):
    if training:
        out, save_mean, save_rstd, new_mean, new_var = aten._native_batch_norm_legit_functional(
            x, w, b, mean, var, True, momentum, eps)
        return out, save_mean, save_rstd, new_mean, new_var
    return tuple(aten._native_batch_norm_legit_no_training(x, w, b, mean, var, momentum, eps))


_op("batch_norm", C, lambda x, w, b, mean, var, momentum=0.1, eps=1e-5: _batch_norm(
    x, w, b, mean, var, False, momentum, eps)[0],
    "batch_norm(x, w, b, running_mean, running_var) {momentum, eps}: inference form",
    flop_rule=_norm_flops, traits=CHEAP, cost_class="normalization")
_op("batch_norm_train", C, lambda x, w, b, mean, var, momentum=0.1, eps=1e-5: _batch_norm(
    x, w, b, mean, var, True, momentum, eps),
    "batch_norm in training: -> out, batch mean, batch rstd, new running mean, new running var",
    num_outputs=5, flop_rule=_norm_flops, traits=CHEAP, cost_class="normalization")
_op("batch_norm_backward", C, lambda g, x, w, mean, var, save_mean, save_rstd, eps=1e-5,
    mask=(True, True, True): tuple(r for r in aten.native_batch_norm_backward(
        g, x, w, mean, var, save_mean, save_rstd, True, eps, list(mask)) if r is not None),
    "batch_norm_backward(grad, x, w, running_mean, running_var, save_mean, save_rstd)",
    num_outputs=None, flop_rule=lambda o, r, a: 2 * _norm_flops(o, r, a), traits=CHEAP,
    cost_class="normalization")


def _nll_loss(x, target, weight=None, reduction=1, ignore_index=-100):
    return tuple(aten.nll_loss_forward(x, target, weight, reduction, ignore_index))


_op("nll_loss", C, _nll_loss,
    "nll_loss(logp, target, weight?) {reduction, ignore_index} -> loss, total_weight",
    num_outputs=2, traits=CHEAP, cost_class="normalization")
_op("nll_loss_backward", C, lambda g, x, target, total_weight, weight=None, reduction=1,
    ignore_index=-100: aten.nll_loss_backward(g, x, target, weight, reduction, ignore_index,
                                              total_weight),
    "nll_loss_backward(grad, logp, target, total_weight, weight?) {reduction, ignore_index}",
    traits=CHEAP, cost_class="normalization")
