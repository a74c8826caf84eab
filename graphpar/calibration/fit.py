"""Fitting the cost model's formulas to measured times: a roofline per op class, alpha-beta per
collective kind.

Both fits minimize the squared *relative* error (model - measured) / measured over the samples,
so that a 1 us call and a 100 ms call weigh the same, with every coefficient kept >= 0 (an exact
non-negative least squares: the problems have two or three unknowns).

Roofline (one op class; FLOPs and bytes as the registry counts them, `OpDef.flops` and
`OpDef.bytes_accessed`):

    t = max(flops / F, bytes / B) + overhead

The max is linear once each sample's regime is known, and the regime is set by the sample's
arithmetic intensity (flops / bytes below F / B: memory-bound). So the fit tries every split of
the samples sorted by intensity, solves the linear problem of each, and keeps the best under
the max model itself (of equally good fits, the one that calls more samples memory-bound).
Noiseless samples from both regimes give the coefficients back exactly. Given `overhead` (the
per-call time measured on tiny calls), the fit takes it as is and fits the two rates. A
class none of whose samples is bound by arithmetic (elementwise ops read and write more bytes
than they compute FLOPs) has no F to measure: `flops` is None, and likewise `bandwidth`.

Alpha-beta (one collective kind, the formulas of `graphpar.cost.communication` on n ranks):

    t = steps(n) * latency + factor(n) * nbytes / bandwidth

In step (`fit_in_step`, whole programs profiled node by node): each class's and kind's
measured seconds over the two fits' prediction, and a per-node dispatch time, which the
calibration folds into the rates (`graphpar.calibration.calibrate`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from graphpar.cost.communication import collective_terms

__all__ = ["AlphaBetaFit", "InStepFit", "RooflineFit", "fit_alpha_beta", "fit_in_step",
           "fit_roofline", "nnls", "roofline_seconds"]


def nnls(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin ||design @ x - target|| subject to x >= 0, exactly, by trying every set of free
    columns (the problems here have at most three)."""
    columns = design.shape[1]
    # unit columns: a per-call overhead of microseconds beside bytes / bandwidth of tens of
    # milliseconds would otherwise lose digits in the solve
    scale = np.linalg.norm(design, axis=0)
    scale[scale == 0] = 1.0
    scaled = design / scale
    best, best_error = np.zeros(columns), float(np.sum(target ** 2))
    for k in range(1, columns + 1):
        for free in itertools.combinations(range(columns), k):
            sub, *_ = np.linalg.lstsq(scaled[:, free], target, rcond=None)
            sub = sub / scale[list(free)]
            if np.any(sub < 0):
                continue
            x = np.zeros(columns)
            x[list(free)] = sub
            error = float(np.sum((design @ x - target) ** 2))
            if error < best_error * (1 - 1e-12):
                best, best_error = x, error
    return best


def _relative(predicted: np.ndarray, measured: np.ndarray) -> tuple[float, ...]:
    return tuple(float(r) for r in (predicted - measured) / measured)


def roofline_seconds(flops: float, nbytes: float, rate: float | None,
                     bandwidth: float | None, overhead: float) -> float:
    """max(flops / rate, nbytes / bandwidth) + overhead; a missing rate or bandwidth bounds
    nothing."""
    compute = flops / rate if rate else 0.0
    memory = nbytes / bandwidth if bandwidth else 0.0
    return max(compute, memory) + overhead


@dataclass(frozen=True)
class RooflineFit:
    """Achieved FLOP/s, bytes/s and seconds per call of one op class, and the fit's relative
    error per sample. `flops` / `bandwidth` are None when no sample was bound by them."""

    flops: float | None
    bandwidth: float | None
    overhead: float
    residuals: tuple[float, ...]

    def seconds(self, flops: float, nbytes: float) -> float:
        return roofline_seconds(flops, nbytes, self.flops, self.bandwidth, self.overhead)


def fit_roofline(samples: Sequence[tuple[float, float, float]],
                 overhead: float | None = None) -> RooflineFit:
    """The roofline through `samples` of (FLOPs, bytes, seconds). `overhead`: the per-call
    seconds measured directly on tiny calls, taken as is, the rates fitted to the rest of each
    time (large shapes alone cannot tell a few microseconds per call from a slightly lower
    rate: they fit 0, or, with a slow path among them, milliseconds); None fits it too."""
    if len(samples) < 2:
        raise ValueError(f"a roofline fit needs at least 2 samples, got {len(samples)}")
    if overhead is not None and not overhead >= 0:
        raise ValueError(f"overhead must be >= 0 seconds, got {overhead!r}")
    data = np.array(sorted(samples, key=lambda s: s[0] / max(s[1], 1e-300)), dtype=float)
    flops, nbytes, seconds = data[:, 0], data[:, 1], data[:, 2]
    weight = 1.0 / seconds
    fixed = overhead is not None
    target = (seconds - (overhead or 0.0)) * weight  # what the rates have to account for
    best: tuple[float, np.ndarray] | None = None
    # samples [0, split) memory-bound, the rest compute-bound; from all memory-bound down, so
    # that of equally good fits the one with fewer compute-bound samples wins (samples all of
    # one intensity fit either roof: an elementwise op is called memory-bound)
    for split in range(len(data), -1, -1):
        memory = np.arange(len(data)) < split
        design = np.stack([np.where(memory, 0.0, flops), np.where(memory, nbytes, 0.0),
                           np.zeros(len(data)) if fixed else np.ones(len(data))], axis=1)
        x = nnls(design * weight[:, None], target)
        if fixed:
            x[2] = overhead
        predicted = np.maximum(flops * x[0], nbytes * x[1]) + x[2]
        error = float(np.sum(((predicted - seconds) * weight) ** 2))
        if best is None or error < best[0] - 1e-12 * len(data):  # a real improvement only
            best = (error, x)
    x = best[1].copy()  # type: ignore[union-attr]
    # A roof no sample is strictly under was not measured, only bounded (the fit may put the
    # lowest-intensity sample of an all-compute-bound class on the ridge): drop it.
    compute, memory = flops * x[0], nbytes * x[1]
    if not np.any(memory > compute * (1 + 1e-6)):
        x[1] = 0.0
    if not np.any(compute > memory * (1 + 1e-6)):
        x[0] = 0.0
    fit = RooflineFit(flops=float(1.0 / x[0]) if x[0] > 0 else None,
                      bandwidth=float(1.0 / x[1]) if x[1] > 0 else None, overhead=float(x[2]),
                      residuals=())
    # residuals in the caller's order of samples
    predicted = np.array([fit.seconds(f, b) for f, b, _ in samples])
    measured = np.array([s for _, _, s in samples], dtype=float)
    return RooflineFit(fit.flops, fit.bandwidth, fit.overhead, _relative(predicted, measured))


@dataclass(frozen=True)
class AlphaBetaFit:
    """Latency per step (s) and bandwidth (bytes/s) of one collective kind (None when the
    samples show no cost per byte), and the fit's relative error per sample."""

    latency: float
    bandwidth: float | None
    residuals: tuple[float, ...]


def fit_alpha_beta(samples: Sequence[tuple[str, int, float, float]]) -> AlphaBetaFit:
    """One (latency, bandwidth) through `samples` of (kind, ranks n, nbytes, seconds): several
    kinds and group sizes may share a link, each priced by its own formula."""
    if len(samples) < 2:
        raise ValueError(f"an alpha-beta fit needs at least 2 samples, got {len(samples)}")
    terms = [collective_terms(kind, n) for kind, n, _, _ in samples]
    steps = np.array([t[0] for t in terms])
    moved = np.array([t[1] * nbytes for t, (_, _, nbytes, _) in zip(terms, samples)])
    seconds = np.array([s[3] for s in samples], dtype=float)
    weight = 1.0 / seconds
    x = nnls(np.stack([steps, moved], axis=1) * weight[:, None], np.ones(len(samples)))
    predicted = steps * x[0] + moved * x[1]
    return AlphaBetaFit(latency=float(x[0]), bandwidth=float(1.0 / x[1]) if x[1] > 0 else None,
                        residuals=_relative(predicted, seconds))


@dataclass(frozen=True)
class InStepFit:
    """How much slower ops run inside a step than alone in a loop.

    `factors`: per op class or collective kind, the measured seconds of its nodes over the
    seconds the loop-fitted model predicts for them (a ratio of sums, so that the class's share
    of a step comes out right); `collectives`: per collective kind, (latency factor, bandwidth
    factor) fitted to its nodes' latency and bandwidth terms separately (in a step a small
    collective pays most for waking the other rank, a large one little more than alone);
    `dispatch` + `dispatch_per_byte` x its results' bytes: what each priced node adds to a
    step beyond the priced nodes' own measured times (the interpreter between nodes, free view
    ops, and, growing with the bytes, fresh memory allocated and freed); `residuals`: per program,
    (corrected estimate - measured step) / measured step; `totals`: per class or kind, its
    priced nodes, their predicted and their measured seconds (what the factors divide)."""

    factors: dict[str, float]
    collectives: dict[str, tuple[float, float]]
    dispatch: float
    residuals: tuple[float, ...]
    totals: dict[str, tuple[int, float, float]]
    dispatch_per_byte: float = 0.0


def fit_in_step(programs: Sequence[tuple], bounds: tuple[float, float] = (0.25, 20.0)
                ) -> InStepFit:
    """Fit `InStepFit` to `programs`: each (nodes, measured step seconds[, bytes of its priced
    nodes' results]). A node is (class or kind, predicted seconds, measured seconds), a
    collective's with its prediction's (latency term, bandwidth term) as a fourth item. Nodes
    predicted free (0 s) are the dispatch's; factors are clipped to `bounds`. The time left
    between the priced nodes is fitted per node and per result byte over the programs
    (relative to each step, so a small program counts as much as a large one); with one
    program, or no bytes, it is all per node."""
    if not programs:
        raise ValueError("an in-step fit needs at least one profiled program")
    totals: dict[str, tuple[int, float, float]] = {}
    terms: dict[str, list[tuple[float, float, float]]] = {}
    for nodes, *_ in programs:
        for kind, p, m, *split in nodes:
            if p > 0:
                count, predicted, measured = totals.get(kind, (0, 0.0, 0.0))
                totals[kind] = (count + 1, predicted + p, measured + m)
                if split:
                    terms.setdefault(kind, []).append((*split[0], m))
    factors = {k: float(np.clip(measured / predicted, *bounds))
               for k, (_, predicted, measured) in sorted(totals.items())}
    collectives = {}
    for kind, rows in terms.items():
        data = np.array(rows, dtype=float)
        x = nnls(data[:, :2], data[:, 2]) if len(rows) >= 2 else np.zeros(2)
        if not x.all():  # one term alone cannot say: both scale alike
            x = np.array([factors[kind], factors[kind]])
        collectives[kind] = (float(np.clip(x[0], *bounds)), float(np.clip(x[1], *bounds)))

    def corrected(kind: str, p: float, split: list) -> float:
        if split and kind in collectives:
            return collectives[kind][0] * split[0][0] + collectives[kind][1] * split[0][1]
        return factors[kind] * p

    rows, left = [], []
    for nodes, step, *result_bytes in programs:
        priced = sum(1 for _, p, *_ in nodes if p > 0)
        rows.append((priced / step, (result_bytes[0] if result_bytes else 0.0) / step))
        left.append((step - sum(corrected(k, p, split) for k, p, _, *split in nodes if p > 0))
                    / step)
    per_node, per_byte = _dispatch(np.array(rows, dtype=float), np.array(left))
    residuals = []
    for (nodes, step, *_), (n, r) in zip(programs, rows):
        estimate = sum(corrected(k, p, split) for k, p, _, *split in nodes if p > 0)
        residuals.append((estimate + (per_node * n + per_byte * r) * step - step) / step)
    return InStepFit(factors, collectives, per_node, tuple(residuals), totals, per_byte)


def _dispatch(rows: np.ndarray, left: np.ndarray) -> tuple[float, float]:
    """(seconds per node, seconds per result byte) >= 0 that best explain `left` (each
    program's unexplained share of its step) from `rows` (its priced nodes and result bytes,
    per second of step); all per node when the bytes cannot tell them apart."""
    if len(rows) >= 2 and rows[:, 1].any():
        scale = 1.0 / np.maximum(rows.max(axis=0), 1e-300)  # nodes and bytes on one footing
        x = nnls(rows * scale, left) * scale
        return float(x[0]), float(x[1])
    nodes = rows[:, 0].sum()
    return (max(0.0, float(left @ rows[:, 0] / (rows[:, 0] @ rows[:, 0]))) if nodes else 0.0,
            0.0)
