"""What lower-cuda computes with: buffers, views of them, and elementwise expressions not yet
in memory (pending), with the helpers that reshape views and expressions."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphpar.errors import UnsupportedOpError
from graphpar.ir.cuda_listing import Addr

__all__ = ["Buf", "Pending", "View", "as_expr", "broadcast_view", "contiguous_strides",
           "kernel_digest", "leaves", "map_leaves", "permute_view"]

@dataclass(eq=False)
class Buf:
    """A buffer in the arena (or a graph input's place in the state region)."""

    name: str
    nbytes: int
    state: Addr | None = None  # a graph input: fixed in the state region
    output: bool = False  # a graph output lives to the end


@dataclass(frozen=True)
class View:
    """A tensor in memory: `shape` elements of `dtype` at `buf` + `offset` elements, with
    `strides` in elements (0 for a broadcast dim)."""

    buf: Buf
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype

    @property
    def contiguous(self) -> bool:
        return self.strides == contiguous_strides(self.shape) or math.prod(self.shape) <= 1

    @property
    def whole(self) -> bool:
        """Exactly its buffer's elements, densely, in order."""
        return (self.offset == 0 and self.contiguous
                and math.prod(self.shape) * self.itemsize == self.buf.nbytes)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Pending:
    """An elementwise expression not yet in memory: leaves are views broadcast to `shape`."""

    expr: Any  # ("leaf", View) | ("const", value) | ("apply", op, (args...), attrs)
    shape: tuple[int, ...]
    dtype: torch.dtype


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def broadcast_view(v: View, shape: tuple[int, ...]) -> View:
    """`v` read as `shape` (numpy broadcasting: new leading dims and size-1 dims repeat)."""
    lead = len(shape) - len(v.shape)
    if lead < 0 or any(size not in (1, want) for size, want in zip(v.shape, shape[lead:])):
        raise UnsupportedOpError(f"cannot broadcast {list(v.shape)} to {list(shape)}")
    strides = [0] * lead + [0 if size == 1 and want != 1 else s
                            for size, want, s in zip(v.shape, shape[lead:], v.strides)]
    return View(v.buf, v.offset, shape, tuple(strides), v.dtype)


def permute_view(v: View, dims: Sequence[int]) -> View:
    return View(v.buf, v.offset, tuple(v.shape[d] for d in dims),
                tuple(v.strides[d] for d in dims), v.dtype)


def map_leaves(expr: Any, fn) -> Any:
    if expr[0] == "leaf":
        return ("leaf", fn(expr[1]))
    if expr[0] == "const":
        return expr
    return ("apply", expr[1], tuple(map_leaves(a, fn) for a in expr[2]), expr[3])


def leaves(expr: Any) -> list[View]:
    if expr[0] == "leaf":
        return [expr[1]]
    if expr[0] == "const":
        return []
    return [v for a in expr[2] for v in leaves(a)]


def as_expr(x: Any, shape: tuple[int, ...]) -> Any:
    """An operand as an expression over views broadcast to `shape` (a number: a literal)."""
    if isinstance(x, View):
        return ("leaf", broadcast_view(x, shape))
    if isinstance(x, Pending):
        if x.shape == shape:
            return x.expr
        return map_leaves(x.expr, lambda v: broadcast_view(v, shape))
    if isinstance(x, (bool, int, float)):
        return ("const", x)
    raise UnsupportedOpError(f"operand {x!r} is not a tensor or a number")


def kernel_digest(params: Sequence[tuple[str, Any]], drop: Sequence[str] = ()) -> str:
    """A kernel's name: a hash of what its source depends on (not where its operands are)."""
    text = repr([(k, v) for k, v in params if k not in drop])
    return hashlib.sha1(text.encode()).hexdigest()[:10]
