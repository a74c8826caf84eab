"""The CPU forms of the index-computing kernels (`index_kernels`): each computes, with torch,
what its CUDA C computes, from the same call parameters and over the same memory."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from graphpar.ir.cuda_listing import Call

__all__ = ["run_index_kernel"]


def _dense(ex: Any, c: Call, key: str, dtype: str, shape) -> torch.Tensor:
    shape = tuple(shape)
    strides = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return ex.tensor(c[key], dtype, shape, strides)


def _put(ex: Any, c: Call, key: str, dtype: str, value: torch.Tensor) -> None:
    shape = tuple(value.shape)
    ex._write(c[key], dtype, shape, tuple(math.prod(shape[d + 1:]) for d in range(len(shape))),
              value.contiguous())


def run_index_kernel(ex: Any, c: Call) -> None:
    """Run index kernel call `c` on CPU listing executor `ex`."""
    kind = c.kind.split(".", 1)[1]
    dt = c.get("dtype")
    if kind in ("im2col", "col2im", "max_pool2d", "max_pool2d_backward"):
        n, ch, h, w = c["image"]
        ho, wo = c["out_hw"]
        window = dict(kernel_size=tuple(c["kernel"]), dilation=tuple(c["dilation"]),
                      padding=tuple(c["padding"]), stride=tuple(c["stride"]))
        kk = c["kernel"][0] * c["kernel"][1]
        if kind == "im2col":
            _put(ex, c, "cols", dt, F.unfold(_dense(ex, c, "x", dt, (n, ch, h, w)), **window))
        elif kind == "col2im":
            cols = _dense(ex, c, "cols", dt, (n, ch * kk, ho * wo))
            _put(ex, c, "x", dt, F.fold(cols, (h, w), **window))
        elif kind == "max_pool2d":
            x = _dense(ex, c, "x", dt, (n, ch, h, w))
            y, idx = torch.ops.aten.max_pool2d_with_indices(
                x, list(c["kernel"]), list(c["stride"]), list(c["padding"]),
                list(c["dilation"]), c["ceil_mode"])
            _put(ex, c, "y", dt, y)
            _put(ex, c, "indices", "i64", idx)
        else:  # each output gradient added at its window's recorded maximum
            g = _dense(ex, c, "grad", dt, (n * ch, ho * wo))
            idx = _dense(ex, c, "indices", "i64", (n * ch, ho * wo))
            y = torch.zeros(n * ch, h * w, dtype=g.dtype).scatter_add_(1, idx, g)
            _put(ex, c, "y", dt, y.view(n, ch, h, w))
    elif kind == "cumsum":
        shape = (c["outer"], c["length"], c["inner"])
        x = _dense(ex, c, "x", c["x_dtype"], shape)
        y = torch.cumsum(x, 1, dtype=ex.torch_dtype(c["y_dtype"]))
        _put(ex, c, "y", c["y_dtype"], y)
    elif kind == "topk":  # (value, then index) order: a stable sort
        x = _dense(ex, c, "x", dt, (c["outer"], c["length"], c["inner"]))
        values, order = torch.sort(x, dim=1, descending=c["largest"], stable=True)
        _put(ex, c, "values", dt, values[:, :c["k"]])
        _put(ex, c, "indices", c["index_dtype"], order[:, :c["k"]])
    elif kind == "scatter":
        out = _dense(ex, c, "out", dt, c["out_shape"])
        index = _dense(ex, c, "index", c["index_dtype"], c["index_shape"]).long()
        src = ex.tensor(c["src"], dt, c["index_shape"], c["src_strides"])
        fn = torch.scatter_add if c["mode"] == "add" else torch.scatter
        _put(ex, c, "out", dt, fn(out, c["dim"], index, src))
    else:
        raise KeyError(c.kind)
