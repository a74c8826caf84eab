"""Exact elimination of the sharding ILP's leaf and chain variables before a solver sees them.

With no memory row (a layer priced alone by `slice-stages`, `--memory-limit none`), the ILP is
a pairwise min-sum problem: minimise sum_c U_c(x_c) + sum_(a,b) E_ab(x_a, x_b) over one choice
x_c per variable. A variable c touched by at most two edges can be minimised out exactly:

- no edge: U_c is independent of the rest; x_c = argmin U_c, and it adds min U_c;
- one edge to a: the terms with x_c are E_ac(x_a, x_c) + U_c(x_c), so
  min over everything = min over the rest of [rest + T(x_a)], T(x_a) = min_j E_ac(x_a, j) + U_c(j),
  a new cost of a's choices;
- two edges, to a and b: likewise T(x_a, x_b) = min_j E_ac(x_a, j) + U_c(j) + E_cb(j, x_b), a
  new edge between a and b (added to theirs if they already share one).

No other term reads x_c, so the smaller problem has the same optimum, and any optimum of it
extends to an optimum of the whole by picking each removed x_c as its argmin given its
neighbours' choices, in reverse order of removal (Dechter's bucket elimination restricted to
width 2, which keeps every term pairwise, so the rest is still Alpa's linearised ILP). A memory
limit couples every variable through one row, so the elimination is only used without one.
Ties go to the lowest-numbered choice.

`solve_exactly` goes all the way: every variable is eliminated into a table over its
neighbours (of any number), and no MIP is left, as long as no table would be large. On Alpa's
GPT-39B setting that solves 136 of the 139 layer ILPs (tables of at most 2^18 entries) in
about a sixth of HiGHS' time; `eliminate` alone leaves the MIP a third of the classes
(docs/pipeline.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Step:
    """One removed variable: its costs and its edges to its neighbours when it was removed."""

    c: int
    unary: np.ndarray
    neighbours: tuple[int, ...]
    edges: tuple[np.ndarray, ...]  # per neighbour: [neighbour's choice, c's choice]


@dataclass
class Eliminated:
    """What is left for the solver (`kept` variables, their costs and the edges between their
    positions in `kept`) and how to extend its choices to the removed variables."""

    kept: list[int]
    unary: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    constant: float = 0.0  # the removed isolated variables' least costs
    steps: list[_Step] = field(default_factory=list)

    def picks(self, kept_picks: list[int], count: int) -> list[int]:
        """One choice per variable (0 for those outside the problem) from the solver's choice
        per kept variable."""
        picks = [0] * count
        for c, p in zip(self.kept, kept_picks):
            picks[c] = int(p)
        for step in reversed(self.steps):
            total = step.unary.copy()
            for n, m in zip(step.neighbours, step.edges):
                total = total + m[picks[n]]
            picks[step.c] = int(np.argmin(total))
        return picks


def eliminate(variables: list[int], unary: dict[int, np.ndarray],
              edges: dict[tuple[int, int], np.ndarray]) -> Eliminated:
    """Remove every variable of `variables` with at most two edges, until none is left.
    `unary[c]`: c's cost per choice; `edges[(a, b)]` (a < b): [a's choice, b's choice]."""
    unary = {c: np.asarray(unary[c], dtype=float) for c in variables}
    pair = {key: np.asarray(m, dtype=float) for key, m in edges.items()}
    adjacent: dict[int, set[int]] = {c: set() for c in variables}
    for a, b in pair:
        adjacent[a].add(b)
        adjacent[b].add(a)

    def take(c: int, n: int) -> np.ndarray:  # the edge as [n's choice, c's choice]
        return pair.pop((n, c)) if n < c else pair.pop((c, n)).T

    steps, constant = [], 0.0
    queue = [c for c in variables if len(adjacent[c]) <= 2]
    while queue:
        c = queue.pop()
        if c not in unary or len(adjacent[c]) > 2:
            continue
        neighbours = tuple(sorted(adjacent.pop(c)))
        mats = tuple(take(c, n) for n in neighbours)
        u = unary.pop(c)
        steps.append(_Step(c, u, neighbours, mats))
        for n in neighbours:
            adjacent[n].discard(c)
        if not neighbours:
            constant += float(u.min())
        elif len(neighbours) == 1:
            (a,), (m,) = neighbours, mats
            unary[a] = unary[a] + (m + u[None, :]).min(axis=1)
        else:
            (a, b), (ma, mb) = neighbours, mats
            # [a's choice, c's choice, b's choice], then c minimised out
            through = (ma[:, :, None] + u[None, :, None] + mb.T[None, :, :]).min(axis=1)
            pair[(a, b)] = pair[(a, b)] + through if (a, b) in pair else through
            adjacent[a].add(b)
            adjacent[b].add(a)
        queue += [n for n in neighbours if len(adjacent[n]) <= 2]
    kept = [c for c in variables if c in unary]
    position = {c: i for i, c in enumerate(kept)}
    return Eliminated(kept, [unary[c] for c in kept],
                      {(position[a], position[b]): m for (a, b), m in pair.items()},
                      constant, steps)


# Tables of more entries than this make the full elimination slower than the MIP: above it,
# `solve_exactly` declines and the ILP is solved after `eliminate`.
MOST_ENTRIES = 1 << 18


@dataclass
class _Factor:
    variables: tuple[int, ...]  # ascending; the table's axes in this order
    table: np.ndarray


def solve_exactly(variables: list[int], unary: dict[int, np.ndarray],
                  edges: dict[tuple[int, int], np.ndarray], count: int,
                  most_entries: int = MOST_ENTRIES) -> list[int] | None:
    """An optimal choice per variable (0 outside `variables`, `count` in all) by eliminating
    every variable, each into a table over its neighbours (bucket elimination, any width), or
    None when an elimination order (least table first) would make a table of more than
    `most_entries` entries. Exact for the reason `eliminate` is, without its width limit: a
    table is the least cost of the removed part for each choice of the variables it touches."""
    size = {c: len(unary[c]) for c in variables}
    adjacent: dict[int, set[int]] = {c: set() for c in variables}
    for a, b in edges:
        adjacent[a].add(b)
        adjacent[b].add(a)
    order, left = [], set(variables)

    def entries(c: int) -> int:
        return int(np.prod([size[n] for n in adjacent[c]] + [size[c]], dtype=np.int64))

    while left:  # the order first, on the graph alone: give up before any table is made
        c = min(left, key=lambda v: (entries(v), v))
        if entries(c) > most_entries:
            return None
        order.append(c)
        for n in adjacent[c]:
            adjacent[n] |= adjacent[c] - {n}
            adjacent[n].discard(c)
        left.discard(c)
    holding: dict[int, list[_Factor]] = {c: [] for c in variables}  # factors by first in order
    rank = {c: i for i, c in enumerate(order)}

    def place(f: _Factor) -> None:
        if f.variables:
            holding[min(f.variables, key=rank.__getitem__)].append(f)

    for c in variables:
        place(_Factor((c,), np.asarray(unary[c], dtype=float)))
    for (a, b), m in edges.items():
        place(_Factor((a, b), np.asarray(m, dtype=float)))
    eliminated: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    for c in order:
        scope = tuple(sorted({v for f in holding[c] for v in f.variables}))
        total = np.zeros([size[v] for v in scope])
        for f in holding[c]:
            total = total + f.table.reshape([size[v] if v in f.variables else 1 for v in scope])
        axis = scope.index(c)
        eliminated.append((c, scope, total))
        place(_Factor(scope[:axis] + scope[axis + 1:], total.min(axis=axis)))
    picks = [0] * count
    for c, scope, total in reversed(eliminated):  # every other variable of scope is set
        index = tuple(slice(None) if v == c else picks[v] for v in scope)
        picks[c] = int(np.argmin(total[index]))
    return picks
