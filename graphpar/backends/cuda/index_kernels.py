"""CUDA C of the index-computing kernels: convolution windows (im2col, col2im), max pooling and
its backward, top-k, cumulative sums and scatters.

Each kind is a `KernelKind`: its source from the call's parameters, the call parameters holding
its pointer arguments (in the kernel's order) and how many threads it needs (one grid-stride
loop over them). Every kernel gathers: each thread writes only its own outputs, so results do
not depend on thread order, except `scatter`, whose duplicate indices are as unordered as
torch's (`scatter_add` adds them atomically).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from graphpar.backends.cuda.c_source import STORAGE, compute_type, grid_stride, literal, load, store
from graphpar.errors import UnsupportedOpError
from graphpar.ir.cuda_listing import Call

__all__ = ["INDEX_KERNELS", "KernelKind"]


@dataclass(frozen=True)
class KernelKind:
    source: Callable[[Call], str]
    arguments: tuple[str, ...]
    threads: Callable[[Call], int]


def _unflatten(names: list[str], sizes: list[int], index: str = "i") -> list[str]:
    """C lines splitting flat index `index` into `names` (the last one varies fastest)."""
    lines = [f"long long r = {index};"]
    for name, size in zip(reversed(names), reversed(sizes)):
        lines += [f"const long long {name} = r % {size}LL;", f"r /= {size}LL;"]
    return lines


def _window(call: Call) -> tuple[int, ...]:
    (kh, kw), (sh, sw) = call["kernel"], call["stride"]
    (ph, pw), (dh, dw) = call["padding"], call["dilation"]
    return kh, kw, sh, sw, ph, pw, dh, dw


def _image(call: Call) -> tuple[int, int, int, int, int, int]:
    n, c, h, w = call["image"]
    ho, wo = call["out_hw"]
    return n, c, h, w, ho, wo


# ------------------------------------------------------------------------- convolution windows

def _im2col(call: Call) -> str:
    """cols[n, c, i, j, oh, ow] = x[n, c, oh·sh − ph + i·dh, ow·sw − pw + j·dw] (0 outside)."""
    t = STORAGE[call["dtype"]]
    n, c, h, w, ho, wo = _image(call)
    kh, kw, sh, sw, ph, pw, dh, dw = _window(call)
    body = _unflatten(["n", "c", "ki", "kj", "oh", "ow"], [n, c, kh, kw, ho, wo])
    body += [f"const long long ih = oh * {sh}LL - {ph}LL + ki * {dh}LL;",
             f"const long long iw = ow * {sw}LL - {pw}LL + kj * {dw}LL;",
             f"const bool inside = ih >= 0 && ih < {h}LL && iw >= 0 && iw < {w}LL;",
             f"cols[i] = inside ? x[((n * {c}LL + c) * {h}LL + ih) * {w}LL + iw] : ({t})0;"]
    return grid_stride(call["name"], [f"const {t}* x", f"{t}* cols"], n * c * kh * kw * ho * wo,
                       body)


def _col2im(call: Call) -> str:
    """x[n, c, h, w] = the sum of the cols entries im2col read from (n, c, h, w): a gather over
    the window taps, so no two threads add into one element."""
    dt = call["dtype"]
    t, ct = STORAGE[dt], compute_type(dt)
    n, c, h, w, ho, wo = _image(call)
    kh, kw, sh, sw, ph, pw, dh, dw = _window(call)
    body = _unflatten(["n", "c", "ih", "iw"], [n, c, h, w])
    body += [f"{ct} acc = ({ct})0;",
             f"for (long long ki = 0; ki < {kh}LL; ++ki) {{",
             f"  const long long sh_ = ih + {ph}LL - ki * {dh}LL;",
             f"  if (sh_ < 0 || sh_ % {sh}LL != 0 || sh_ / {sh}LL >= {ho}LL) continue;",
             f"  for (long long kj = 0; kj < {kw}LL; ++kj) {{",
             f"    const long long sw_ = iw + {pw}LL - kj * {dw}LL;",
             f"    if (sw_ < 0 || sw_ % {sw}LL != 0 || sw_ / {sw}LL >= {wo}LL) continue;",
             f"    acc += {load(dt, f'cols[(((n * {c}LL + c) * {kh}LL + ki) * {kw}LL + kj) * {ho * wo}LL + (sh_ / {sh}LL) * {wo}LL + sw_ / {sw}LL]')};",  # noqa: E501
             "  }", "}", f"x[i] = {store(dt, 'acc')};"]
    return grid_stride(call["name"], [f"const {t}* cols", f"{t}* x"], n * c * h * w, body)


# ------------------------------------------------------------------------- max pooling

def _max_pool2d(call: Call) -> str:
    """Each output's window maximum and its flat h·W + w index (torch's: the first maximum; a
    NaN wins; an all −inf window keeps its first in-image position)."""
    dt = call["dtype"]
    t, ct = STORAGE[dt], compute_type(dt)
    n, c, h, w, ho, wo = _image(call)
    kh, kw, sh, sw, ph, pw, dh, dw = _window(call)
    body = _unflatten(["n", "c", "oh", "ow"], [n, c, ho, wo])
    body += [f"long long h0 = oh * {sh}LL - {ph}LL;", f"long long w0 = ow * {sw}LL - {pw}LL;",
             f"while (h0 < 0) h0 += {dh}LL;", f"while (w0 < 0) w0 += {dw}LL;",
             f"const {t}* plane = x + (n * {c}LL + c) * {h * w}LL;",
             f"{ct} best = {literal(-math.inf, ct)};", f"long long arg = h0 * {w}LL + w0;",
             f"for (long long ki = 0; ki < {kh}LL; ++ki) {{",
             f"  const long long ih = oh * {sh}LL - {ph}LL + ki * {dh}LL;",
             f"  if (ih < 0 || ih >= {h}LL) continue;",
             f"  for (long long kj = 0; kj < {kw}LL; ++kj) {{",
             f"    const long long iw = ow * {sw}LL - {pw}LL + kj * {dw}LL;",
             f"    if (iw < 0 || iw >= {w}LL) continue;",
             f"    const {ct} v = {load(dt, f'plane[ih * {w}LL + iw]')};",
             f"    if (v > best || v != v) {{ best = v; arg = ih * {w}LL + iw; }}",
             "  }", "}", f"y[i] = {store(dt, 'best')};", "indices[i] = arg;"]
    return grid_stride(call["name"], [f"const {t}* x", f"{t}* y", "long long* indices"],
                       n * c * ho * wo, body)


def _max_pool2d_backward(call: Call) -> str:
    """dx[n, c, h, w] = the sum of the output gradients whose recorded maximum is (h, w): each
    thread visits the (at most one per tap) outputs whose window holds its element."""
    dt = call["dtype"]
    t, ct = STORAGE[dt], compute_type(dt)
    n, c, h, w, ho, wo = _image(call)
    kh, kw, sh, sw, ph, pw, dh, dw = _window(call)
    body = _unflatten(["n", "c", "ih", "iw"], [n, c, h, w])
    body += [f"const long long plane = (n * {c}LL + c) * {ho * wo}LL;",
             f"const long long self = ih * {w}LL + iw;", f"{ct} acc = ({ct})0;",
             f"for (long long ki = 0; ki < {kh}LL; ++ki) {{",
             f"  const long long sh_ = ih + {ph}LL - ki * {dh}LL;",
             f"  if (sh_ < 0 || sh_ % {sh}LL != 0 || sh_ / {sh}LL >= {ho}LL) continue;",
             f"  for (long long kj = 0; kj < {kw}LL; ++kj) {{",
             f"    const long long sw_ = iw + {pw}LL - kj * {dw}LL;",
             f"    if (sw_ < 0 || sw_ % {sw}LL != 0 || sw_ / {sw}LL >= {wo}LL) continue;",
             f"    const long long o = plane + (sh_ / {sh}LL) * {wo}LL + sw_ / {sw}LL;",
             f"    if (indices[o] == self) acc += {load(dt, 'grad[o]')};",
             "  }", "}", f"y[i] = {store(dt, 'acc')};"]
    return grid_stride(call["name"], [f"const {t}* grad", "const long long* indices", f"{t}* y"],
                       n * c * h * w, body)


# ------------------------------------------------------------------------- lines of a tensor

def _lines(call: Call) -> list[str]:
    """A thread per line along the scanned dim: element l of line (o, in) is at
    (o·length + l)·inner + in."""
    length, inner = call["length"], call["inner"]
    return [f"const long long base = (i / {inner}LL) * {length * inner}LL + i % {inner}LL;"]


def _line_threads(call: Call) -> int:
    return call["outer"] * call["inner"]


def _cumsum(call: Call) -> str:
    xd, yd = call["x_dtype"], call["y_dtype"]
    acc = "double" if "f64" in (xd, yd) else ("long long" if yd in ("i64", "i32", "i16", "i8",
                                                                      "u8", "bool") else "float")
    inner = call["inner"]
    body = _lines(call) + [f"{acc} acc = ({acc})0;",
                           f"for (long long l = 0; l < {call['length']}LL; ++l) {{",
                           f"  acc += ({acc}){load(xd, f'x[base + l * {inner}LL]')};",
                           f"  y[base + l * {inner}LL] = {store(yd, 'acc')};", "}"]
    return grid_stride(call["name"], [f"const {STORAGE[xd]}* x", f"{STORAGE[yd]}* y"],
                       _line_threads(call), body)


def _topk(call: Call) -> str:
    """The k first elements of each line in the order (value descending — ascending when not
    `largest` —, then index ascending; a NaN counts as the largest value): pick t is the first
    element strictly after pick t − 1 in that order, so no per-thread memory is needed."""
    dt = call["dtype"]
    t, ct = STORAGE[dt], compute_type(dt)
    length, inner, k = call["length"], call["inner"], call["k"]
    out_base = f"(i / {inner}LL) * {k * inner}LL + i % {inner}LL"
    sign = "" if call["largest"] else "-"
    # a before b: a's key is larger (NaN largest), or keys tie and a's index is smaller
    before = ("((ka != ka && kb == kb) || ka > kb || ((ka == kb || (ka != ka && kb != kb)) "
              "&& ia < ib))")
    body = _lines(call) + [
        f"const long long out = {out_base};",
        f"{ct} prev_key = ({ct})0;", "long long prev = -1;",
        f"for (long long p = 0; p < {k}LL; ++p) {{",
        f"  {ct} best_key = ({ct})0;", "  long long best = -1;",
        f"  for (long long l = 0; l < {length}LL; ++l) {{",
        f"    const {ct} key = {sign}{load(dt, f'x[base + l * {inner}LL]')};",
        "    bool after_prev = prev < 0;",
        "    if (!after_prev) {",
        "      const " + ct + " ka = prev_key, kb = key; const long long ia = prev, ib = l;",
        f"      after_prev = {before};",
        "    }",
        "    if (!after_prev) continue;",
        "    bool better = best < 0;",
        "    if (!better) {",
        "      const " + ct + " ka = key, kb = best_key; const long long ia = l, ib = best;",
        f"      better = {before};",
        "    }",
        "    if (better) { best = l; best_key = key; }",
        "  }",
        f"  values[out + p * {inner}LL] = x[base + best * {inner}LL];",
        f"  indices[out + p * {inner}LL] = ({STORAGE[call['index_dtype']]})best;",
        "  prev = best; prev_key = best_key;",
        "}"]
    return grid_stride(call["name"], [f"const {t}* x", f"{t}* values",
                                      f"{STORAGE[call['index_dtype']]}* indices"],
                       _line_threads(call), body)


# ------------------------------------------------------------------------- scatter

def _scatter(call: Call) -> str:
    """out[.., index[m], ..] = src[m] (dim `dim`) for every element m of index; `add` adds
    (atomically: several m may name one element)."""
    dt = call["dtype"]
    t, it = STORAGE[dt], STORAGE[call["index_dtype"]]
    shape, out_shape, dim = call["index_shape"], call["out_shape"], call["dim"]
    out_strides = [math.prod(out_shape[d + 1:]) for d in range(len(out_shape))]
    names = [f"m{d}" for d in range(len(shape))]
    body = _unflatten(names, list(shape))
    terms = [f"(long long)index[i] * {out_strides[d]}LL" if d == dim
             else f"{names[d]} * {out_strides[d]}LL" for d in range(len(shape))]
    src = " + ".join(f"{names[d]} * {s}LL" for d, s in enumerate(call["src_strides"]))
    body += [f"const long long o = {' + '.join(terms)};"]
    if call["mode"] == "add":
        if dt not in ("f32", "f64"):
            raise UnsupportedOpError("scatter_add's atomic adds need f32 or f64")
        body.append(f"atomicAdd(&out[o], src[{src}]);")
    else:
        body.append(f"out[o] = src[{src}];")
    return grid_stride(call["name"], [f"const {it}* index", f"const {t}* src", f"{t}* out"],
                       math.prod(shape), body)


def _image_threads(call: Call) -> int:
    n, c, h, w, ho, wo = _image(call)
    return n * c * h * w


def _out_threads(call: Call) -> int:
    n, c, h, w, ho, wo = _image(call)
    return n * c * ho * wo


INDEX_KERNELS: dict[str, KernelKind] = {
    "kernel.im2col": KernelKind(_im2col, ("x", "cols"), lambda c: _out_threads(c)
                                * c["kernel"][0] * c["kernel"][1]),
    "kernel.col2im": KernelKind(_col2im, ("cols", "x"), _image_threads),
    "kernel.max_pool2d": KernelKind(_max_pool2d, ("x", "y", "indices"), _out_threads),
    "kernel.max_pool2d_backward": KernelKind(_max_pool2d_backward, ("grad", "indices", "y"),
                                             _image_threads),
    "kernel.cumsum": KernelKind(_cumsum, ("x", "y"), _line_threads),
    "kernel.topk": KernelKind(_topk, ("x", "values", "indices"), _line_threads),
    "kernel.scatter": KernelKind(_scatter, ("index", "src", "out"),
                                 lambda c: math.prod(c["index_shape"])),
}
