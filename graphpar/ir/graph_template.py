"""Graphs over symbolic sizes: one graph captured at a few sizes, specialized to any size.

graphpar's IR has static shapes, but a serving step's token count changes every iteration. A
:class:`GraphTemplate` is fitted from a base graph and, per symbol, one graph captured with only
that symbol changed. The graphs must be the same program (ops, operands, attributes, order;
the graph's own attributes are the base graph's);
every integer that differs between them (a dimension of a type, a ``reshape`` shape, an
``arange`` end, ...) is fitted as ``c + sum_s a_s * s`` with integer slopes. ``specialize(T=37)``
then rebuilds the graph with those integers evaluated, without capturing again.

Fitting checks what it can: the skeletons must match, slopes must be integers, and a
specialization at fresh sizes must pass the verifier (types re-inferred from each op's rule),
which catches a size that is not affine in the symbols.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from graphpar.errors import GraphparError
from graphpar.ir.graph import Graph
from graphpar.ir.types import TensorType
from graphpar.ir.verify import verify

__all__ = ["GraphTemplate", "TemplateError", "map_ints"]


class TemplateError(GraphparError):
    """Graphs captured at different sizes are not one program with affine sizes."""


def _map_scalar(x: Any, fn: Callable[[int], int]) -> Any:
    if isinstance(x, bool) or not isinstance(x, (int, tuple)):
        return x
    if isinstance(x, int):
        return fn(x)
    return tuple(_map_scalar(v, fn) for v in x)


def _map_type(t: TensorType, fn: Callable[[int], int]) -> TensorType:
    return TensorType(tuple(fn(d) for d in t.shape), t.dtype)


def map_ints(graph: Graph, fn: Callable[[int], int]) -> Graph:
    """A copy of ``graph`` with every integer (type dims, attributes, inline operands) replaced
    by ``fn(value)``, visited in a fixed order. Booleans are not integers here."""
    return graph.copy(map_type=lambda t: _map_type(t, fn),
                      map_constant=lambda x: _map_scalar(x, fn))


def _ints(graph: Graph) -> list[int]:
    found: list[int] = []

    def record(v: int) -> int:
        found.append(v)
        return v
    map_ints(graph, record)
    return found


@dataclass(frozen=True)
class _Patch:
    index: int  # position in the graph's integer stream
    constant: int  # value at the base sizes
    slopes: tuple[tuple[str, int], ...]  # (symbol, slope)


class GraphTemplate:
    """A graph whose integers are affine in named symbols (e.g. tokens ``T``, sequences ``N``).

    Build with :meth:`fit`; :meth:`specialize` returns (and caches) the graph at given sizes.
    """

    def __init__(self, base: Graph, base_sizes: dict[str, int], patches: list[_Patch],
                 cache_size: int = 256) -> None:
        self.base = base
        self.base_sizes = dict(base_sizes)
        self.symbols = tuple(base_sizes)
        self._patches = {p.index: p for p in patches}
        self._cache: OrderedDict[tuple[int, ...], Graph] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def fit(cls, base: Graph, base_sizes: Mapping[str, int],
            variants: Mapping[str, tuple[int, Graph]], probe: Mapping[str, int] | None = None
            ) -> GraphTemplate:
        """Fit from ``base`` (captured at ``base_sizes``) and, per symbol, ``(size, graph)``
        captured with only that symbol changed. ``probe``: sizes to verify a specialization at
        (default: each base size + 3)."""
        if set(variants) != set(base_sizes):
            raise TemplateError(f"need one variant graph per symbol {sorted(base_sizes)}, got "
                                f"{sorted(variants)}")
        zero = map_ints(base, lambda v: 0)
        base_ints = _ints(base)
        deltas: dict[str, list[int]] = {}
        for sym, (size, graph) in variants.items():
            step = size - base_sizes[sym]
            if step == 0:
                raise TemplateError(f"variant of {sym} has the base size {size}")
            skeleton = map_ints(graph, lambda v: 0)
            skeleton.attrs = zero.attrs  # graph attributes (estimates, notes) may differ by size
            if skeleton != zero:
                raise TemplateError(
                    f"graph @{base.name} captured at {sym}={size} is a different program than at "
                    f"{sym}={base_sizes[sym]}: ops, operands or attributes changed with the size")
            ints = _ints(graph)
            slopes = []
            for b, v in zip(base_ints, ints):
                if (v - b) % step:
                    raise TemplateError(
                        f"graph @{base.name}: a size goes {b} -> {v} when {sym} goes "
                        f"{base_sizes[sym]} -> {size}, which is not an integer multiple of {sym}")
                slopes.append((v - b) // step)
            deltas[sym] = slopes
        patches = []
        for i, b in enumerate(base_ints):
            slopes = tuple((s, deltas[s][i]) for s in base_sizes if deltas[s][i])
            if slopes:
                constant = b - sum(a * base_sizes[s] for s, a in slopes)
                patches.append(_Patch(i, constant, slopes))
        template = cls(base, dict(base_sizes), patches)
        probe = dict(probe or {s: n + 3 for s, n in base_sizes.items()})
        try:
            verify(template.specialize(**probe))
        except GraphparError as exc:
            raise TemplateError(f"graph @{base.name} does not specialize to {probe}: {exc}"
                                ) from None
        return template

    @property
    def num_varying(self) -> int:
        """How many integers of the graph depend on the symbols."""
        return len(self._patches)

    def specialize(self, **sizes: int) -> Graph:
        """The graph at these sizes (every symbol given); cached, so treat it as read-only."""
        if set(sizes) != set(self.symbols):
            raise TemplateError(f"give sizes for {', '.join(self.symbols)}, got {sorted(sizes)}")
        key = tuple(sizes[s] for s in self.symbols)
        graph = self._cache.get(key)
        if graph is not None:
            self._cache.move_to_end(key)
            return graph
        if key == tuple(self.base_sizes[s] for s in self.symbols):
            graph = self.base
        else:
            counter = iter(range(1 << 62))
            patches = self._patches

            def value(v: int) -> int:
                patch = patches.get(next(counter))
                if patch is None:
                    return v
                return patch.constant + sum(a * sizes[s] for s, a in patch.slopes)
            graph = map_ints(self.base, value)
        self._cache[key] = graph
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return graph
