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

On Alpa's GPT-39B setting the layer ILPs lose about two thirds of their variables and half of
their edges this way (docs/pipeline.md)."""

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
