"""Token slicing (TeraPipe): cut one sequence into slices so a pipeline of K identical stages
is fed slices instead of whole sequences.

- `TokenLatency`: a stage's latency for a slice of l tokens after c tokens of context,
  t(l, c) = t_fwd(l, 0) + t_ctx(l, c) with t_ctx = a0 + a1*l + a2*c + a3*l*c (Eq. 2.9),
  forward and backward together. `transformer_latency` derives it from graphpar's cost
  model (FLOPs over the cluster's peak, plus sending the slice's activations to the next
  stage); `fit` fits it from measured points and reports its error on held-back ones.
- `solve_token_slices`: the DP of Eq. 2.6-2.8, min over t_max of S*(L; t_max) + (K-1)*t_max,
  a branch and bound over t_max with the early stop and an epsilon gap (optimal within
  K*epsilon); `solve_batch_and_tokens` runs it per batch-slice size and keeps the best.

The `slice-tokens` pass that applies them to a graph is in `slice_tokens.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from graphpar.cost.communication import collective_time
from graphpar.cost.compute import SKINNY_ROWS, Roofline
from graphpar.errors import PassError
from graphpar.ir.cluster import ComputeRate

# Backward of a matmul is two matmuls of the same size: forward + backward = 3x forward.
BACKWARD_FACTOR = 3.0
# A transformer layer's projection matmuls: q, k, v, out, MLP up and down (roofline calls).
_MATMULS_PER_LAYER = 6


@dataclass(frozen=True)
class TokenLatency:
    """Seconds one stage spends on a slice of `l` tokens after `c` tokens of context (forward and
    backward): `base[l]` is t(l, 0) for l = 0..seq_len; `ctx` is (a0, a1, a2, a3) of Eq. 2.9.
    `fit_error` is the relative error on held-back points when the model was fitted."""

    base: tuple[float, ...]
    ctx: tuple[float, float, float, float]
    fit_error: float | None = None

    @property
    def seq_len(self) -> int:
        return len(self.base) - 1

    def __call__(self, length: int, context: int) -> float:
        a0, a1, a2, a3 = self.ctx
        extra = a0 + a1 * length + a2 * context + a3 * length * context if context else 0.0
        return self.base[length] + extra


def transformer_latency(seq_len: int, hidden: int, heads: int, ffn: int,
                        layers_per_stage: int, compute: Roofline | float, itemsize: int = 4,
                        send_bandwidth: float = float("inf"), send_latency: float = 0.0,
                        overhead: float = 0.0, batch: int = 1, tensor_parallel: int = 1,
                        allreduce_bandwidth: float = float("inf"),
                        allreduce_latency: float = 0.0) -> TokenLatency:
    """The latency model of a stage of `layers_per_stage` transformer layers on `batch`
    sequences at once, priced by the cost model's roofline `compute` (`graphpar.cost.compute`;
    a number: FLOPs at that peak, nothing else), forward and backward (BACKWARD_FACTOR), plus
    sending the slice's activations [batch, l, hidden] forward and their gradients back
    (`send_latency` + bytes / `send_bandwidth`), plus `overhead` seconds per layer per slice
    (framework costs beyond the roofline's per-call overhead).

    Per layer, a slice of l tokens after c tokens: the projections (q, k, v, out: 4 h^2) and the
    MLP (2 h f) cost 2 b l (4 h^2 + 2 h f) FLOPs at the gemm class's rate (`gemm_skinny` when
    b l is at most SKINNY_ROWS rows), but never less time than reading their weights once per
    pass at that class's bandwidth (the roofline's memory side: why one token costs about as
    much as a hundred on a GPU), plus six calls' overhead; attention q k^T and p v cost 2 * 2 h
    per (query, key) pair at the attention class's rate, and token i of the slice sees c + i + 1
    keys, so 4 h b (l c + l (l+1) / 2). Only the 4 h b l c term depends on the context:
    t_ctx = a3 l c with a3 = 4 h b / (attention FLOP/s) per layer (`heads` changes how
    attention is split, not its FLOPs; it is kept for the caller's record).

    `tensor_parallel` = m splits every matmul's FLOPs and weights m ways inside a node
    (Megatron-style) at the price of 4 all-reduces of the slice's activations per layer (two
    forward, two backward) at `allreduce_bandwidth` / `allreduce_latency`, and each of the m
    devices sends 1/m of the activations to the next stage.
    """
    if min(seq_len, hidden, heads, ffn, layers_per_stage, batch, tensor_parallel) < 1:
        raise PassError("transformer_latency: seq_len, hidden, heads, ffn, layers_per_stage, "
                        "batch and tensor_parallel must be positive")
    m = tensor_parallel
    lengths = np.arange(seq_len + 1, dtype=np.float64)
    weights = (4 * hidden * hidden + 2 * hidden * ffn) / m
    roof = Roofline.coerce(compute)
    big, skinny, attend = roof.rate("gemm"), roof.rate("gemm_skinny"), roof.rate("attention")

    def projections(rate: ComputeRate) -> np.ndarray:
        bound = np.maximum(2 * batch * lengths * weights / rate.flops,
                           weights * itemsize / rate.bandwidth)
        return bound + _MATMULS_PER_LAYER * rate.overhead

    matmul = np.where(batch * lengths <= SKINNY_ROWS, projections(skinny), projections(big))
    attention = (4 * hidden / m * batch * lengths * (lengths + 1) / 2 / attend.flops
                 + attend.overhead)
    activation = batch * lengths * hidden * itemsize
    allreduce = np.array([4 * collective_time("all_reduce", nbytes, m, allreduce_bandwidth,
                                              allreduce_latency) for nbytes in activation])
    per_layer = BACKWARD_FACTOR * (matmul + attention) + allreduce + overhead
    send = 2 * (send_latency + activation / m / send_bandwidth)
    base = per_layer * layers_per_stage + send
    base[0] = 0.0
    a3 = BACKWARD_FACTOR * layers_per_stage * 4 * hidden / m * batch / attend.flops
    return TokenLatency(tuple(float(x) for x in base), (0.0, 0.0, 0.0, a3))


def fit(points: Sequence[tuple[int, int, float]], seq_len: int, holdout: float = 0.25,
        seed: int = 0) -> TokenLatency:
    """Fit the latency model to measured (length, context, seconds) points: t(l, 0) from the
    points without context (linearly interpolated between measured lengths), then a0..a3 by
    least squares on what context adds (Eq. 2.9), on all but a random `holdout` share of the
    points with context. `fit_error` is the mean relative error on those held back."""
    data = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    no_ctx = data[data[:, 1] == 0]
    if len(no_ctx) < 1:
        raise PassError("fit: give at least one point with context 0 (t_fwd(l, 0))")
    order = np.argsort(no_ctx[:, 0])
    known_l = np.concatenate([[0.0], no_ctx[order, 0]])
    known_t = np.concatenate([[0.0], no_ctx[order, 2]])
    base = np.interp(np.arange(seq_len + 1), known_l, known_t)
    with_ctx = data[data[:, 1] > 0]
    if len(with_ctx) < 5:
        raise PassError(f"fit: {len(with_ctx)} points with context; give at least 5 (4 to fit "
                        "a0..a3, the rest to check the fit)")
    rng = np.random.default_rng(seed)
    shuffled = with_ctx[rng.permutation(len(with_ctx))]
    held = max(1, int(round(holdout * len(shuffled)))) if holdout > 0 else 0
    held = min(held, len(shuffled) - 4)
    check, train = shuffled[:held], shuffled[held:]
    length, context = train[:, 0], train[:, 1]
    design = np.stack([np.ones_like(length), length, context, length * context], axis=1)
    extra = train[:, 2] - base[train[:, 0].astype(int)]
    coef = np.linalg.lstsq(design, extra, rcond=None)[0]
    model = TokenLatency(tuple(float(x) for x in base), tuple(float(x) for x in coef))
    error = None
    if held:
        predicted = np.array([model(int(p[0]), int(p[1])) for p in check])
        error = float(np.mean(np.abs(predicted - check[:, 2]) / np.abs(check[:, 2])))
    return TokenLatency(model.base, model.ctx, error)


@dataclass(frozen=True)
class TokenSlicing:
    """The DP's answer: slice lengths in tokens (first to last), the estimated pipeline latency
    sum(t_i) + (K-1) max(t_i) in seconds, the bound on how far it may be above the optimum
    (K * epsilon seconds), how many t_max bounds it evaluated and its own wall time."""

    slices: tuple[int, ...] = ()
    est_seconds: float = 0.0
    gap_bound_seconds: float = 0.0
    evaluated: int = 0
    dp_seconds: float = 0.0
    # set by the slice-tokens pass: the microbatches' sizes, the same step unsliced, and each
    # slice's time as a share of the whole sequence's on the slowest stage (for the timeline)
    batch_slices: tuple[int, ...] = ()
    est_unsliced_seconds: float = 0.0
    slice_shares: tuple[float, ...] = ()


def pipeline_seconds(latency: TokenLatency, slices: Sequence[int], stages: int,
                     repeats: int = 1) -> float:
    """Eq. 2.5 for given slice lengths: sum of the slices' times + (K-1) * the slowest; with
    `repeats` batch slices each sliced alike, back to back in one pipeline, the sum `repeats`
    times over."""
    times, context = [], 0
    for length in slices:
        times.append(latency(length, context))
        context += length
    return repeats * sum(times) + (stages - 1) * max(times)


def solve_token_slices(latency: TokenLatency, stages: int, granularity: int = 1,
                       epsilon: float = 0.0, repeats: int = 1) -> TokenSlicing:
    """The slicing of the whole sequence that minimizes Eq. 2.5 on `stages` stages, every slice a
    multiple of `granularity` tokens (the sequence length must be one too); `repeats` batch
    slices sliced alike go through the pipeline back to back (`pipeline_seconds`). With
    epsilon > 0, bounds whose best possible latency is within stages * epsilon of the best
    found are not evaluated, so the answer is within stages * epsilon seconds of the optimum."""
    seq_len = latency.seq_len
    if stages < 1:
        raise PassError(f"stages={stages}: give at least 1")
    if granularity < 1 or seq_len % granularity:
        raise PassError(f"granularity={granularity} does not divide the sequence length "
                        f"{seq_len}; choose a divisor of it (e.g. 1 or 8)")
    if epsilon < 0:
        raise PassError(f"epsilon={epsilon}: give a number >= 0 (seconds)")
    if repeats < 1:
        raise PassError(f"repeats={repeats}: give at least 1 batch slice")
    started = time.perf_counter()
    base = np.ascontiguousarray(np.asarray(latency.base, dtype=np.float64)[::granularity])
    ctx = np.asarray(latency.ctx, dtype=np.float64)
    slices_units, seconds, evaluated = _search(base, ctx, granularity, _grows_with_length(
        base, ctx, granularity), stages, repeats, float(stages * epsilon))
    return TokenSlicing(tuple(int(k) * granularity for k in slices_units), float(seconds),
                        stages * epsilon, int(evaluated), time.perf_counter() - started)


def _grows_with_length(base: np.ndarray, ctx: np.ndarray, granularity: int) -> bool:
    """Whether t(l, c) never shrinks as l grows at any context c (every real model): then the
    slices that fit under a bound are a prefix of lengths, found by a break or a bisection,
    instead of a scan over all of them."""
    units = len(base) - 1
    if units < 2:
        return True
    step = float(np.min(np.diff(base[1:])))
    a1, a3 = ctx[1], ctx[3]
    # c runs over granularity .. (units - 1) * granularity; a1 + a3 c is linear, so its ends.
    ctx_step = granularity * (a1 + min(a3 * granularity, a3 * (units - 1) * granularity))
    return step >= 0 and step + min(0.0, ctx_step) >= 0


@njit(cache=True, inline="always")
def _t(base, ctx, granularity, k, c):
    """t(k, c) in units of `granularity` tokens (Eq. 2.9): one formula for the DP, the bound
    search and the pricing, so a bound equals the slice time it came from bit for bit."""
    if c == 0:
        return base[k]
    length = k * granularity
    context = c * granularity
    return base[k] + ctx[0] + ctx[1] * length + ctx[2] * context + ctx[3] * length * context


@njit(cache=True)
def _best_under(base, ctx, granularity, monotone, bound, best, choice):
    """S*(i; bound) for every i (Eq. 2.8) into `best`, the last slice's length into `choice`,
    pushing from each start c the slices no slower than `bound`. When t grows with the length
    the first slice over the bound ends the lengths from c, so the work is sum_c k_max(c)."""
    units = base.shape[0] - 1
    best[0] = 0.0
    for i in range(1, units + 1):
        best[i] = np.inf
        choice[i] = 0
    for c in range(units):
        if best[c] == np.inf:
            continue
        for k in range(1, units - c + 1):
            t = _t(base, ctx, granularity, k, c)
            if t > bound:
                if monotone:
                    break
                continue
            if best[c] + t < best[c + k]:
                best[c + k] = best[c] + t
                choice[c + k] = k


@njit(cache=True)
def _largest_time_at_most(base, ctx, granularity, monotone, bound):
    """The largest slice time t(k, c) <= bound, -inf if none: the next t_max below a covered
    range. With t growing in the length, a bisection per context; else a scan of all."""
    units = base.shape[0] - 1
    found = -np.inf
    for c in range(units):
        if monotone:
            lo, hi = 0, units - c  # largest k in [1, units - c] with t <= bound; 0 if none
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _t(base, ctx, granularity, mid, c) <= bound:
                    lo = mid
                else:
                    hi = mid - 1
            if lo > 0:
                found = max(found, _t(base, ctx, granularity, lo, c))
        else:
            for k in range(1, units - c + 1):
                t = _t(base, ctx, granularity, k, c)
                if t <= bound and t > found:
                    found = t
    return found


@njit(cache=True)
def _smallest_time(base, ctx, granularity, monotone):
    units = base.shape[0] - 1
    found = np.inf
    for c in range(units):
        for k in range(1, units - c + 1):
            found = min(found, _t(base, ctx, granularity, k, c))
            if monotone:
                break
    return found


@njit(cache=True)
def _search(base, ctx, granularity, monotone, stages, repeats, gap):
    """min over bounds t_max of r S*(L; t_max) + (K-1) t_max (Eq. 2.6, r = `repeats` batch
    slices alike), branch and bound over the range of t_max. Evaluating the DP at a bound p
    gives a slicing of sum S = S*(L; p) whose slowest slice is M <= p; S*(L; t) = S for every
    t in [M, p] (S* never grows with t and that slicing fits under t), so the evaluation
    settles the whole range [M, p] at once, with the slicing's own latency r S + (K-1) M.
    A range (lo, hi] not settled yet holds slicings whose slowest slice is in it; they cost at
    least r S*(L; hi) + (K-1) lo and, times being non-negative, at least (r + K-1) lo (the
    early stop), and S*(L; hi) is at least the S found at any bound above hi. A range whose
    bound is within `gap` of the best found is dropped (gap 0: exact); else it is split at the
    largest slice time below its middle, geometric when the range spans many scales."""
    units = base.shape[0] - 1
    best = np.empty(units + 1)
    choice = np.zeros(units + 1, dtype=np.int64)
    best_cost = np.inf
    best_slices = np.zeros(0, dtype=np.int64)
    evaluated = 0
    t_min = _smallest_time(base, ctx, granularity, monotone)
    t_max = _largest_time_at_most(base, ctx, granularity, monotone, np.inf)
    nonnegative = t_min >= 0
    # ranges (lo, hi] to settle and a lower bound on S* inside: a stack of parallel arrays
    los = [np.nextafter(t_min, -np.inf)]  # just below the fastest slice
    his = [t_max]
    sums = [-np.inf]
    while len(los) > 0:
        lo = los.pop()
        hi = his.pop()
        s_floor = sums.pop()
        bound = repeats * s_floor + (stages - 1) * lo
        if nonnegative:
            bound = max(bound, (repeats + stages - 1) * lo)
        if bound >= best_cost - gap:
            continue
        if lo > 0 and hi > 4 * lo:
            middle = math.sqrt(lo * hi)
        else:
            middle = lo + 0.5 * (hi - lo)
        p = _largest_time_at_most(base, ctx, granularity, monotone, middle)
        if p <= lo:
            p = hi  # no slice time in (lo, middle]: hi is one
        evaluated += 1
        _best_under(base, ctx, granularity, monotone, p, best, choice)
        total = best[units]
        slowest = p
        if total < np.inf:
            slowest = -np.inf
            at = units
            while at > 0:
                k = choice[at]
                slowest = max(slowest, _t(base, ctx, granularity, k, at - k))
                at -= k
            cost = repeats * total + (stages - 1) * slowest
            if cost < best_cost:
                best_cost = cost
                slices = []
                at = units
                while at > 0:
                    slices.append(choice[at])
                    at -= choice[at]
                best_slices = np.array(slices[::-1], dtype=np.int64)
        # (p, hi] keeps its floor; (lo, slowest) gets S*(L; p) as one
        if hi > p:
            los.append(p)
            his.append(hi)
            sums.append(s_floor)
        if total == np.inf:
            continue  # nothing fits under p, so nothing under anything below it
        below = _largest_time_at_most(base, ctx, granularity, monotone,
                                      np.nextafter(slowest, -np.inf))
        if below > lo:
            los.append(lo)
            his.append(below)
            sums.append(total)
    return best_slices, best_cost, evaluated


@dataclass(frozen=True)
class BatchTokenSlicing:
    """Batch and token slicing together (TeraPipe 2.3.4): the batch cut into slices of
    `batch_slices[d]` sequences, each sliced along its tokens as `token_slices[d]`, all of them
    back to back through one pipeline; the estimate is Eq. 2.5 over every (batch slice, token
    slice) pair (seconds)."""

    batch_slices: tuple[int, ...]
    token_slices: tuple[tuple[int, ...], ...]
    est_seconds: float
    dp_seconds: float


def solve_batch_and_tokens(latency_of_batch: Callable[[int], TokenLatency], batch: int,
                           stages: int, granularity: int = 1,
                           epsilon: float = 0.0) -> BatchTokenSlicing:
    """Run the token DP for every batch-slice size b dividing `batch` (`latency_of_batch(b)`: the
    latency model of b sequences at once), the batch/b slices back to back in one pipeline,
    and keep the fastest. Equal batch slices, not the paper's knapsack over unequal ones: the
    knapsack adds up a whole pipeline latency per batch slice, fill and drain included, which
    prices GPipe's microbatches as if they ran one after another."""
    if batch < 1:
        raise PassError(f"batch={batch}: give at least 1 sequence")
    started = time.perf_counter()
    best = None
    for size in (b for b in range(1, batch + 1) if batch % b == 0):
        got = solve_token_slices(latency_of_batch(size), stages, granularity, epsilon,
                                 repeats=batch // size)
        if best is None or got.est_seconds < best[1].est_seconds:
            best = (size, got)
    size, got = best
    count = batch // size
    return BatchTokenSlicing((size,) * count, (got.slices,) * count, got.est_seconds,
                             time.perf_counter() - started)
