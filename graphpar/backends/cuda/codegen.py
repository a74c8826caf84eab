"""CUDA C for a listing's generated kernels: each `kernel.*` call's source, from its parameters.

A kernel is specialized to its call: shapes, strides, dtypes and the fused expression are
compile-time constants, so the source depends only on the call (its `name` is a hash of the
same parameters) and two calls with one name share one compiled kernel. Operand addresses are
the launch arguments, in the order `kernel_arguments` gives.

The sources use only what NVRTC offers (no host headers), so CuPy's RawModule compiles them
as nvcc does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from graphpar.backends.cuda.c_source import BLOCK, STORAGE
from graphpar.backends.cuda.c_source import compute_type as _compute_type
from graphpar.backends.cuda.c_source import grid_stride as _grid_stride
from graphpar.backends.cuda.c_source import literal as _literal
from graphpar.backends.cuda.c_source import load as _load
from graphpar.backends.cuda.c_source import store as _store
from graphpar.backends.cuda.index_kernels import INDEX_KERNELS
from graphpar.errors import UnsupportedOpError
from graphpar.ir.cuda_listing import Apply, Call, Const, Expr, Leaf, Listing, parse_expr
from graphpar.ir.registry import dtype as torch_dtype
from graphpar.ir.registry import get_op
from graphpar.ir.types import DTYPE_NAMES, TensorType

__all__ = ["BLOCK", "PRELUDE", "kernel_arguments", "kernel_source", "launch_shape",
           "module_source"]

PRELUDE = """\
#ifndef GP_HOST_EMULATION  // tests build the kernels for the host with an emulation header
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

// Block-wide sum and max over BLOCK threads (every thread gets the result).
__device__ __forceinline__ float gp_block_sum(float v, float* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  const float out = red[0];
  __syncthreads();
  return out;
}

__device__ __forceinline__ float gp_block_max(float v, float* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  const float out = red[0];
  __syncthreads();
  return out;
}
"""


# ------------------------------------------------------------------------- expressions

_FLOAT_FUNCS = ("exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh", "erf",
                "floor", "ceil", "trunc", "pow", "fabs", "fmax", "fmin")


def _fn(name: str, ctype: str) -> str:
    """The float (`expf`) or double (`exp`) form of a math function."""
    return name + "f" if ctype == "float" else name


def _formula(op: str, a: list[str], attrs: dict[str, Any], t: str) -> str:
    """C for `op` on operands `a` (already in compute type `t`)."""
    f = {name: _fn(name, t) for name in _FLOAT_FUNCS}
    x = a[0] if a else ""
    unary = {
        "neg": f"(-{x})", "abs": f"({x} < 0 ? -{x} : {x})", "exp": f"{f['exp']}({x})",
        "log": f"{f['log']}({x})", "log1p": f"{f['log1p']}({x})",
        "expm1": f"{f['expm1']}({x})", "sqrt": f"{f['sqrt']}({x})",
        "rsqrt": f"{f['rsqrt']}({x})", "sin": f"{f['sin']}({x})", "cos": f"{f['cos']}({x})",
        "tanh": f"{f['tanh']}({x})", "erf": f"{f['erf']}({x})", "floor": f"{f['floor']}({x})",
        "ceil": f"{f['ceil']}({x})", "trunc": f"{f['trunc']}({x})",
        "sigmoid": f"(({t})1 / (({t})1 + {f['exp']}(-{x})))",
        "relu": f"({x} > 0 ? {x} : ({t})0)", "silu": f"({x} / (({t})1 + {f['exp']}(-{x})))",
        "reciprocal": f"(({t})1 / {x})", "sign": f"(({t})(({x} > 0) - ({x} < 0)))",
        "logical_not": f"(!{x})", "bitwise_not": f"(~{x})", "isnan": f"({x} != {x})",
    }
    if op in unary:
        return unary[op]
    if op == "gelu":
        if attrs.get("approximate", "none") == "tanh":
            return (f"(({t})0.5 * {x} * (({t})1 + {f['tanh']}(({t})0.7978845608028654 * ({x} + "
                    f"({t})0.044715 * {x} * {x} * {x}))))")
        return f"(({t})0.5 * {x} * (({t})1 + {f['erf']}({x} * ({t})0.7071067811865476)))"
    if op == "convert":
        return x
    if op == "clamp":
        out = x
        if attrs.get("min") is not None:
            lo = _literal(attrs["min"], t)
            out = f"({out} < {lo} ? {lo} : {out})"
        if attrs.get("max") is not None:
            hi = _literal(attrs["max"], t)
            out = f"({out} > {hi} ? {hi} : {out})"
        return out
    b = a[1] if len(a) > 1 else ""
    binary = {
        "add": f"({x} + {b})", "sub": f"({x} - {b})", "mul": f"({x} * {b})",
        "pow": f"{f['pow']}({x}, {b})", "eq": f"({x} == {b})", "ne": f"({x} != {b})",
        "lt": f"({x} < {b})", "le": f"({x} <= {b})", "gt": f"({x} > {b})",
        "ge": f"({x} >= {b})", "bitwise_and": f"({x} & {b})", "bitwise_or": f"({x} | {b})",
        "bitwise_xor": f"({x} ^ {b})", "logical_and": f"({x} && {b})",
        "logical_or": f"({x} || {b})",
        # torch.maximum / minimum propagate NaN
        "maximum": f"(({x} != {x}) ? {x} : (({b} != {b}) ? {b} : ({x} > {b} ? {x} : {b})))",
        "minimum": f"(({x} != {x}) ? {x} : (({b} != {b}) ? {b} : ({x} < {b} ? {x} : {b})))",
        "remainder": f"({x} - {f['floor']}({x} / {b}) * {b})",
        "sigmoid_backward": f"({x} * (({t})1 - {b}) * {b})",
        "tanh_backward": f"({x} * (({t})1 - {b} * {b}))",
        "silu_backward": (f"({x} * (({t})1 / (({t})1 + {f['exp']}(-{b}))) * (({t})1 + {b} * "
                          f"(({t})1 - ({t})1 / (({t})1 + {f['exp']}(-{b})))))"),
    }
    if op in binary:
        return binary[op]
    if op == "div":
        mode = attrs.get("rounding_mode")
        q = f"({x} / {b})"
        return {None: q, "floor": f"{f['floor']}{q}", "trunc": f"{f['trunc']}{q}"}[mode]
    if op == "where":
        return f"({a[0]} ? {a[1]} : {a[2]})"
    if op == "threshold_backward":
        return f"({b} <= {_literal(attrs['threshold'], t)} ? ({t})0 : {x})"
    if op == "gelu_backward":
        if attrs.get("approximate", "none") == "tanh":
            inner = f"(({t})0.7978845608028654 * ({b} + ({t})0.044715 * {b} * {b} * {b}))"
            th = f"{f['tanh']}{inner}"
            return (f"({x} * (({t})0.5 * (({t})1 + {th}) + ({t})0.5 * {b} * (({t})1 - {th} * "
                    f"{th}) * ({t})0.7978845608028654 * (({t})1 + ({t})0.134145 * {b} * {b})))")
        return (f"({x} * (({t})0.5 * (({t})1 + {f['erf']}({b} * ({t})0.7071067811865476)) + "
                f"{b} * {f['exp']}(({t})-0.5 * {b} * {b}) * ({t})0.3989422804014327))")
    raise UnsupportedOpError(f"no CUDA C for elementwise op {op!r} in a generated kernel")


_COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")
_LOGICAL = ("logical_and", "logical_or", "logical_not")


def _expression(expr: Expr, leaf_dtypes: Sequence[str], lines: list[str]) -> tuple[str, str]:
    """Append the statements computing `expr`; returns (C name or literal, IR dtype or '')."""
    if isinstance(expr, Leaf):
        return f"v{expr.index}", leaf_dtypes[expr.index]
    if isinstance(expr, Const):
        return repr(expr.value), ""
    assert isinstance(expr, Apply)
    operands = [_expression(a, leaf_dtypes, lines) for a in expr.args]
    attrs = dict(expr.attrs)
    types = [TensorType((), torch_dtype(d)) if d else _python(v) for v, d in operands]
    if not any(d for _, d in operands):  # all literals: the first is a 0-d tensor (as on CPU)
        first = torch.tensor(types[0]).dtype
        types[0] = TensorType((), first)
        operands[0] = (_literal(_python(operands[0][0]), _compute_type(DTYPE_NAMES[first])),
                       DTYPE_NAMES[first])
    result = DTYPE_NAMES[get_op(expr.op).infer(types, attrs)[0].dtype]
    if expr.op in _COMPARE:  # compare in the operands' common type
        metas = [t.meta() if isinstance(t, TensorType) else t for t in types]
        common = DTYPE_NAMES[torch.result_type(*metas)]
        ct = _compute_type(common)
    elif expr.op == "where":
        ct = _compute_type(result)
    elif expr.op in _LOGICAL:
        ct = "bool"
    else:
        ct = _compute_type(result)
    args = []
    for k, (name, dtype) in enumerate(operands):
        want = "bool" if expr.op == "where" and k == 0 else ct
        if not dtype:
            args.append(_literal(_python(name), want))
        else:
            args.append(name if _compute_type(dtype) == want else f"(({want}){name})")
    out = f"t{len(lines)}"
    lines.append(f"const {_compute_type(result)} {out} = "
                 f"({_compute_type(result)}){_formula(expr.op, args, attrs, ct)};")
    return out, result


def _python(text: Any) -> Any:
    """A literal's value from its repr (expressions hold literals as text)."""
    if not isinstance(text, str):
        return text
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return float(text)


# ------------------------------------------------------------------------- kernels

def _offsets(shape: Sequence[int], strides: dict[str, Sequence[int]]) -> list[str]:
    """Statements turning the flat index `i` into each operand's element offset."""
    lines = [f"long long {name} = 0;" for name in strides]
    if not shape:
        return lines
    lines.append("long long r = i;")
    for d in range(len(shape) - 1, -1, -1):
        adds = [f"{name} += c * {s[d]}LL;" for name, s in strides.items() if s[d] and shape[d] > 1]
        if d == 0:
            if adds:
                lines.append("{ const long long c = r; " + " ".join(adds) + " }")
        elif adds:
            lines.append(f"{{ const long long c = r % {shape[d]}LL; r /= {shape[d]}LL; "
                         + " ".join(adds) + " }")
        else:
            lines.append(f"r /= {shape[d]}LL;")
    return lines


def _inputs(call: Call) -> list[str]:
    k, names = 0, []
    while f"in{k}" in call.args:
        names.append(f"in{k}")
        k += 1
    return names


def _pointwise(call: Call) -> str:
    inputs = _inputs(call)
    dtypes = [call[f"{n}_dtype"] for n in inputs]
    shape = call["shape"]
    out_dtype = call["out_dtype"]
    params = [f"{STORAGE[out_dtype]}* out"] + [f"const {STORAGE[d]}* {n}"
                                               for n, d in zip(inputs, dtypes)]
    strides = {"o": call["out_strides"]}
    strides.update({f"o{k}": call[f"{n}_strides"] for k, n in enumerate(inputs)})
    body = _offsets(shape, strides)
    body += [f"const {_compute_type(d)} v{k} = {_load(d, f'{n}[o{k}]')};"
             for k, (n, d) in enumerate(zip(inputs, dtypes))]
    lines: list[str] = []
    value, _ = _expression(parse_expr(call["expr"]), dtypes, lines)
    if value not in [f"v{k}" for k in range(len(inputs))] and not value.startswith("t"):
        value = _literal(_python(value), _compute_type(out_dtype))
    body += lines + [f"out[o] = {_store(out_dtype, value)};"]
    return _grid_stride(call["name"], params, call["n"], body)


def _softmax(call: Call) -> str:
    t, cols = STORAGE[call["dtype"]], call["cols"]
    dt = call["dtype"]
    log = call.kind == "kernel.log_softmax"
    limit = (f"const long long q = (long long)(blockIdx.x % {call['sq']}LL) + 1;\n"
             f"  const long long limit = q < {cols}LL ? q : {cols}LL;" if call["causal"]
             else f"const long long limit = {cols}LL;")
    neg_inf = "__int_as_float(0xff800000)"
    value = ("v - m - logf(s)" if log else "expf(v - m) / s")
    masked = neg_inf if log else "0.0f"
    has_lse = call.get("lse") is not None
    lse_param = f", {t}* lse" if has_lse else ""
    lse_store = (f"  if (threadIdx.x == 0) lse[blockIdx.x] = {_store(dt, 'm + logf(s)')};\n"
                 if has_lse else "")
    return f"""extern "C" __global__ void {call['name']}(const {t}* x, {t}* y{lse_param}) {{
  __shared__ float red[{BLOCK}];
  const {t}* xr = x + (long long)blockIdx.x * {cols}LL;
  {t}* yr = y + (long long)blockIdx.x * {cols}LL;
  {limit}
  float m = {neg_inf};
  for (long long j = threadIdx.x; j < limit; j += blockDim.x) m = fmaxf(m, {_load(dt, 'xr[j]')});
  m = gp_block_max(m, red);
  float s = 0.0f;
  for (long long j = threadIdx.x; j < limit; j += blockDim.x) s += expf({_load(dt, 'xr[j]')} - m);
  s = gp_block_sum(s, red);
{lse_store}  for (long long j = threadIdx.x; j < {cols}LL; j += blockDim.x) {{
    const float v = {_load(dt, 'xr[j]')};
    yr[j] = {_store(dt, f'j < limit ? {value} : {masked}')};
  }}
}}
"""


def _norm(call: Call) -> str:
    t, cols, dt = STORAGE[call["dtype"]], call["cols"], call["dtype"]
    layer = call.kind == "kernel.layer_norm"
    has_w = call.get("w") is not None
    has_b = layer and call.get("b") is not None
    has_stats = layer and call.get("mean") is not None
    params = [f"const {t}* x"] + ([f"const {t}* w"] if has_w else []) + \
        ([f"const {t}* b"] if has_b else []) + [f"{t}* y"] + \
        ([f"{t}* mean_out", f"{t}* rstd_out"] if has_stats else [])
    eps = _literal(call["eps"], "float")
    scale = f" * {_load(dt, 'w[j]')}" if has_w else ""
    shift = f" + {_load(dt, 'b[j]')}" if has_b else ""
    if layer:
        stats = f"""  float s = 0.0f;
  for (long long j = threadIdx.x; j < {cols}LL; j += blockDim.x) s += {_load(dt, 'xr[j]')};
  const float mean = gp_block_sum(s, red) / {cols}.0f;
  float q = 0.0f;
  for (long long j = threadIdx.x; j < {cols}LL; j += blockDim.x) {{
    const float d = {_load(dt, 'xr[j]')} - mean;
    q += d * d;
  }}
  const float rstd = rsqrtf(gp_block_sum(q, red) / {cols}.0f + {eps});"""
        if has_stats:
            stats += (f"\n  if (threadIdx.x == 0) {{ mean_out[blockIdx.x] = {_store(dt, 'mean')}; "
                      f"rstd_out[blockIdx.x] = {_store(dt, 'rstd')}; }}")
        normed = "(v - mean) * rstd"
    else:
        stats = f"""  float q = 0.0f;
  for (long long j = threadIdx.x; j < {cols}LL; j += blockDim.x) {{
    const float v = {_load(dt, 'xr[j]')};
    q += v * v;
  }}
  const float rstd = rsqrtf(gp_block_sum(q, red) / {cols}.0f + {eps});"""
        normed = "v * rstd"
    return f"""extern "C" __global__ void {call['name']}({', '.join(params)}) {{
  __shared__ float red[{BLOCK}];
  const {t}* xr = x + (long long)blockIdx.x * {cols}LL;
  {t}* yr = y + (long long)blockIdx.x * {cols}LL;
{stats}
  for (long long j = threadIdx.x; j < {cols}LL; j += blockDim.x) {{
    const float v = {_load(dt, 'xr[j]')};
    yr[j] = {_store(dt, f'{normed}{scale}{shift}')};
  }}
}}
"""


def _reduce(call: Call) -> str:
    shape, strides, dims = call["shape"], call["x_strides"], set(call["dims"])
    xd, yd = call["x_dtype"], call["y_dtype"]
    kept = [d for d in range(len(shape)) if d not in dims]
    reduced = sorted(dims)
    out_n = math.prod(shape[d] for d in kept)
    red_n = math.prod(shape[d] for d in reduced)
    acc_t = "double" if "f64" in (xd, yd) else ("long long" if yd in ("i64", "i32") else "float")
    op = call["op"]
    integral = acc_t == "long long"
    init = {"sum": "0", "mean": "0",
            "amax": "(-9223372036854775807LL - 1)" if integral else _literal(-math.inf, acc_t),
            "amin": "9223372036854775807LL" if integral else _literal(math.inf, acc_t)}[op]
    step = {"sum": "acc += v;", "mean": "acc += v;",
            "amax": "acc = (v != v || v > acc) ? v : acc;",
            "amin": "acc = (v != v || v < acc) ? v : acc;"}[op]
    body = _offsets([shape[d] for d in kept], {"base": [strides[d] for d in kept]})
    inner = _offsets([shape[d] for d in reduced], {"o": [strides[d] for d in reduced]})
    inner = [line.replace("long long r = i;", "long long r = j;") for line in inner]
    finish = f"acc / ({acc_t}){red_n}" if op == "mean" else "acc"
    body += [f"{acc_t} acc = {init};",
             f"for (long long j = 0; j < {red_n}LL; ++j) {{",
             *["  " + line for line in inner],
             f"  const {acc_t} v = ({acc_t}){_load(xd, 'x[base + o]')};",
             f"  {step}", "}",
             f"y[i] = {_store(yd, finish)};"]
    params = [f"const {STORAGE[xd]}* x", f"{STORAGE[yd]}* y"]
    return _grid_stride(call["name"], params, out_n, body)


def _embedding(call: Call) -> str:
    t, it = STORAGE[call["dtype"]], STORAGE[call["index_dtype"]]
    cols = call["cols"]
    body = [f"const long long row = i / {cols}LL;", f"const long long col = i % {cols}LL;",
            f"y[i] = w[(long long)index[row] * {cols}LL + col];"]
    return _grid_stride(call["name"], [f"const {t}* w", f"const {it}* index", f"{t}* y"],
                        call["rows"] * cols, body)


def _nll_loss(call: Call) -> str:
    t, it = STORAGE[call["dtype"]], STORAGE[call["target_dtype"]]
    dt, classes = call["dtype"], call["classes"]
    weighted = call.get("weight") is not None
    w = _load(dt, "weight[k]") if weighted else "1.0f"
    weight_param = f"const {t}* weight, " if weighted else ""
    finish = "-s / n" if call["reduction"] == 1 else "-s"
    return f"""extern "C" __global__ void {call['name']}(const {t}* logp, const {it}* target,
    {weight_param}{t}* loss, {t}* total_weight) {{
  __shared__ float red[{BLOCK}];
  float s = 0.0f, c = 0.0f;
  for (long long i = threadIdx.x; i < {call['rows']}LL; i += blockDim.x) {{
    const long long k = (long long)target[i];
    if (k != {call['ignore_index']}LL) {{
      const float w = (float){w};
      s += w * (float){_load(dt, f'logp[i * {classes}LL + k]')};
      c += w;
    }}
  }}
  s = gp_block_sum(s, red);
  const float n = gp_block_sum(c, red);
  if (threadIdx.x == 0) {{
    loss[0] = {_store(dt, finish)};
    total_weight[0] = {_store(dt, 'n')};
  }}
}}
"""


def _nll_loss_backward(call: Call) -> str:
    t, it, dt = STORAGE[call["dtype"]], STORAGE[call["target_dtype"]], call["dtype"]
    classes = call["classes"]
    weighted = call.get("weight") is not None
    scale = f"-{_load(dt, 'grad[0]')}" + (f" / {_load(dt, 'total_weight[0]')}"
                                          if call["reduction"] == 1 else "")
    if weighted:
        scale = f"({scale}) * {_load(dt, 'weight[k]')}"
    ignore = call["ignore_index"]
    value = _store(dt, f"(k == col && k != {ignore}LL) ? {scale} : 0.0f")
    body = [f"const long long row = i / {classes}LL;", f"const long long col = i % {classes}LL;",
            "const long long k = (long long)target[row];", f"y[i] = {value};"]
    params = [f"const {t}* grad", f"const {it}* target"] + (
        [f"const {t}* weight"] if weighted else []) + [f"const {t}* total_weight", f"{t}* y"]
    return _grid_stride(call["name"], params, call["rows"] * classes, body)


def _arange(call: Call) -> str:
    t = STORAGE[call["dtype"]]
    ct = _compute_type(call["dtype"])
    start, step = call["start"], call["step"]
    body = [f"y[i] = {_store(call['dtype'], f'({ct})i * ({ct}){step} + ({ct}){start}')};"]
    return _grid_stride(call["name"], [f"{t}* y"], call["n"], body)


def _embedding_backward(call: Call) -> str:
    t, it, cols = STORAGE[call["dtype"]], STORAGE[call["index_dtype"]], call["cols"]
    if call["dtype"] not in ("f32", "f64"):
        raise UnsupportedOpError("embedding_backward's atomic adds need f32 or f64")
    body = [f"const long long row = i / {cols}LL;", f"const long long col = i % {cols}LL;",
            "const long long k = (long long)index[row];",
            f"if (k != {call['padding_idx']}LL) atomicAdd(&y[k * {cols}LL + col], grad[i]);"]
    return _grid_stride(call["name"], [f"const {t}* grad", f"const {it}* index", f"{t}* y"],
                        call["rows"] * cols, body)


_GENERATORS = {"kernel.pointwise": _pointwise, "kernel.softmax": _softmax,
               "kernel.log_softmax": _softmax, "kernel.layer_norm": _norm,
               "kernel.rms_norm": _norm, "kernel.reduce": _reduce,
               "kernel.embedding": _embedding, "kernel.nll_loss": _nll_loss,
               "kernel.nll_loss_backward": _nll_loss_backward, "kernel.arange": _arange,
               "kernel.embedding_backward": _embedding_backward,
               **{kind: k.source for kind, k in INDEX_KERNELS.items()}}


def kernel_source(call: Call) -> str:
    """The CUDA C of one kernel call (without the prelude)."""
    try:
        return _GENERATORS[call.kind](call)
    except KeyError:
        raise UnsupportedOpError(f"no CUDA C generator for {call.kind}") from None


def module_source(calls: Iterable[Call] | Listing) -> str:
    """One compilable module: the prelude and each distinct kernel of `calls` once."""
    calls = calls.calls if isinstance(calls, Listing) else calls
    sources = {}
    for call in calls:
        if call.kind.startswith("kernel.") and call["name"] not in sources:
            sources[call["name"]] = kernel_source(call)
    return PRELUDE + "\n" + "\n".join(sources.values())


def kernel_arguments(call: Call) -> list[str]:
    """The parameters holding the launch's pointer arguments, in the kernel's order."""
    kind = call.kind
    if kind in INDEX_KERNELS:
        return list(INDEX_KERNELS[kind].arguments)
    if kind == "kernel.pointwise":
        return ["out", *_inputs(call)]
    if kind in ("kernel.softmax", "kernel.log_softmax"):
        return ["x", "y"] + (["lse"] if call.get("lse") is not None else [])
    if kind in ("kernel.layer_norm", "kernel.rms_norm"):
        return (["x"] + [k for k in ("w", "b") if call.get(k) is not None] + ["y"]
                + [k for k in ("mean", "rstd") if call.get(k) is not None])
    weight = ["weight"] if call.get("weight") is not None else []
    if kind == "kernel.nll_loss":
        return ["logp", "target", *weight, "loss", "total_weight"]
    if kind == "kernel.nll_loss_backward":
        return ["grad", "target", *weight, "total_weight", "y"]
    if kind == "kernel.arange":
        return ["y"]
    if kind == "kernel.embedding_backward":
        return ["grad", "index", "y"]
    if kind == "kernel.reduce":
        return ["x", "y"]
    if kind == "kernel.embedding":
        return ["weight", "index", "y"]
    raise UnsupportedOpError(f"no launch arguments for {kind}")


def launch_shape(call: Call) -> tuple[int, int]:
    """(blocks, threads per block) of the launch."""
    kind = call.kind
    if kind in ("kernel.softmax", "kernel.log_softmax", "kernel.layer_norm", "kernel.rms_norm"):
        return call["rows"], BLOCK
    if kind == "kernel.nll_loss":
        return 1, BLOCK
    if kind in ("kernel.pointwise", "kernel.arange"):
        n = call["n"]
    elif kind == "kernel.nll_loss_backward":
        n = call["rows"] * call["classes"]
    elif kind in INDEX_KERNELS:
        n = INDEX_KERNELS[kind].threads(call)
    elif kind == "kernel.reduce":
        n = math.prod(s for d, s in enumerate(call["shape"]) if d not in call["dims"])
    else:
        n = call["rows"] * call["cols"]
    return max(1, min(-(-n // BLOCK), 65535)), BLOCK
