"""Token slicing (TeraPipe): cut one sequence into slices so a pipeline of K identical stages
is fed slices instead of whole sequences.

- `TokenLatency`: a stage's latency for a slice of l tokens after c tokens of context,
  t(l, c) = t_fwd(l, 0) + t_ctx(l, c) with t_ctx = a0 + a1*l + a2*c + a3*l*c (Eq. 2.9),
  forward and backward together. `transformer_latency` derives it from graphpar's cost
  model (FLOPs over the cluster's peak, plus sending the slice's activations to the next
  stage); `fit` fits it from measured points and reports its error on held-back ones.
- `solve_token_slices`: the DP of Eq. 2.6-2.8, min over t_max of S*(L; t_max) + (K-1)*t_max,
  t_max ascending with the early stop and an epsilon gap (optimal within K*epsilon);
  `solve_batch_and_tokens` runs it per batch-slice size and splits the batch by a 1-D knapsack.
- the `slice-tokens` pass: reads the sequence length, heads and layers off the graph's causal
  attention, solves, and records the slice lengths in the graph's attrs (`token_slices`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from graphpar.cost.cluster import get_cluster
from graphpar.errors import PassError
from graphpar.ir.graph import Graph
from graphpar.passes.manager import GraphPass, PassContext, register_pass

# Backward of a matmul is two matmuls of the same size: forward + backward = 3x forward.
BACKWARD_FACTOR = 3.0


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

    def table(self, granularity: int = 1) -> np.ndarray:
        """t[k, j]: seconds for a slice of k units after j units of context, a unit being
        `granularity` tokens; inf where k + j exceeds the sequence or k = 0."""
        units = self.seq_len // granularity
        k = np.arange(units + 1)[:, None] * granularity
        j = np.arange(units + 1)[None, :] * granularity
        a0, a1, a2, a3 = self.ctx
        ctx = np.where(j > 0, a0 + a1 * k + a2 * j + a3 * k * j, 0.0)
        t = np.asarray(self.base)[k] + ctx
        return np.where((k > 0) & (k + j <= units * granularity), t, np.inf)


def transformer_latency(seq_len: int, hidden: int, heads: int, ffn: int,
                        layers_per_stage: int, peak_flops: float, itemsize: int = 4,
                        send_bandwidth: float = float("inf"), send_latency: float = 0.0,
                        overhead: float = 0.0) -> TokenLatency:
    """The latency model of a stage of `layers_per_stage` transformer layers, batch 1, from their
    FLOPs at `peak_flops` (the cost model's roofline: dense matmuls at peak), forward and
    backward (BACKWARD_FACTOR), plus sending the slice's activations [l, hidden] forward and
    their gradients back (`send_latency` + bytes / `send_bandwidth`), plus `overhead` seconds
    per layer per slice (kernel calls).

    Per layer, a slice of l tokens after c tokens: the projections (q, k, v, out: 4 h^2) and the
    MLP (2 h f) cost 2 l (4 h^2 + 2 h f) FLOPs; attention q k^T and p v cost 2 * 2 h per
    (query, key) pair, and token i of the slice sees c + i + 1 keys, so 4 h (l c + l (l+1) / 2).
    Only the 4 h l c term depends on the context: t_ctx = a3 l c with a3 = 4 h / peak per layer
    (`heads` changes how attention is split, not its FLOPs; it is kept for the caller's record).
    """
    if min(seq_len, hidden, heads, ffn, layers_per_stage) < 1:
        raise PassError("transformer_latency: seq_len, hidden, heads, ffn and layers_per_stage "
                        "must be positive")
    scale = BACKWARD_FACTOR * layers_per_stage / peak_flops
    lengths = np.arange(seq_len + 1, dtype=np.float64)
    flops = 2 * lengths * (4 * hidden * hidden + 2 * hidden * ffn) \
        + 4 * hidden * lengths * (lengths + 1) / 2
    send = 2 * (send_latency + lengths * hidden * itemsize / send_bandwidth)
    base = flops * scale + send + overhead * layers_per_stage
    base[0] = 0.0
    return TokenLatency(tuple(float(x) for x in base), (0.0, 0.0, 0.0, 4.0 * hidden * scale))


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


def pipeline_seconds(latency: TokenLatency, slices: Sequence[int], stages: int) -> float:
    """Eq. 2.5 for given slice lengths: sum of the slices' times + (K-1) * the slowest."""
    times, context = [], 0
    for length in slices:
        times.append(latency(length, context))
        context += length
    return sum(times) + (stages - 1) * max(times)


def solve_token_slices(latency: TokenLatency, stages: int, granularity: int = 1,
                       epsilon: float = 0.0) -> TokenSlicing:
    """The slicing of the whole sequence that minimizes Eq. 2.5 on `stages` stages, every slice a
    multiple of `granularity` tokens (the sequence length must be one too). With epsilon > 0,
    bounds closer than epsilon are evaluated once, so the answer is within stages * epsilon
    seconds of the optimum."""
    seq_len = latency.seq_len
    if stages < 1:
        raise PassError(f"stages={stages}: give at least 1")
    if granularity < 1 or seq_len % granularity:
        raise PassError(f"granularity={granularity} does not divide the sequence length "
                        f"{seq_len}; choose a divisor of it (e.g. 1 or 8)")
    if epsilon < 0:
        raise PassError(f"epsilon={epsilon}: give a number >= 0 (seconds)")
    started = time.perf_counter()
    table = latency.table(granularity)
    candidates = np.unique(table[np.isfinite(table)])  # every slice's time: the t_max to try
    slices_units, seconds, evaluated = _search(table, candidates, stages, float(epsilon))
    return TokenSlicing(tuple(int(k) * granularity for k in slices_units), float(seconds),
                        stages * epsilon, int(evaluated), time.perf_counter() - started)


@njit(cache=True)
def _best_under(table, bound, best, choice):
    """S*(i; bound) for every i (Eq. 2.8) into `best`, the last slice's length into `choice`."""
    units = table.shape[0] - 1
    best[0] = 0.0
    for i in range(1, units + 1):
        best[i] = np.inf
        choice[i] = 0
        for k in range(1, i + 1):
            t = table[k, i - k]
            if t <= bound and best[i - k] + t < best[i]:
                best[i] = best[i - k] + t
                choice[i] = k


@njit(cache=True)
def _search(table, candidates, stages, epsilon):
    """min over bounds t_max of the pipeline latency of the slicing S*(L; t_max) finds (priced
    with its actual slowest slice), bounds ascending; stops once K * t_max reaches the best
    (every slice costs at least the slowest, so any slicing with a slower one costs more).
    Bounds within epsilon of the window's first are evaluated once, at the window's last."""
    units = table.shape[0] - 1
    best = np.empty(units + 1)
    choice = np.zeros(units + 1, dtype=np.int64)
    best_cost = np.inf
    best_slices = np.zeros(0, dtype=np.int64)
    evaluated = 0
    n = candidates.shape[0]
    i = 0
    while i < n:
        start = candidates[i]
        if stages * start >= best_cost:
            break
        j = i
        while j + 1 < n and candidates[j + 1] < start + epsilon:
            j += 1
        bound = candidates[j]
        i = j + 1
        evaluated += 1
        _best_under(table, bound, best, choice)
        if not np.isfinite(best[units]):
            continue
        slices = []
        slowest = 0.0
        at = units
        while at > 0:
            k = choice[at]
            slices.append(k)
            slowest = max(slowest, table[k, at - k])
            at -= k
        cost = best[units] + (stages - 1) * slowest
        if cost < best_cost:
            best_cost = cost
            best_slices = np.array(slices[::-1], dtype=np.int64)
    return best_slices, best_cost, evaluated


@dataclass(frozen=True)
class BatchTokenSlicing:
    """Batch and token slicing together (TeraPipe 2.3.4): the batch cut into slices of
    `batch_slices[d]` sequences, each sliced along its tokens as `token_slices[d]`; the estimate
    is the sum of the batch slices' pipeline latencies (seconds)."""

    batch_slices: tuple[int, ...]
    token_slices: tuple[tuple[int, ...], ...]
    est_seconds: float
    dp_seconds: float


def split_batch(seconds_per_size: Sequence[float]) -> tuple[int, ...]:
    """The 1-D knapsack: sizes b_1 + ... + b_D = B (B = len(seconds_per_size)) minimizing the sum
    of `seconds_per_size[b - 1]`; sizes in descending order."""
    batch = len(seconds_per_size)
    best = [0.0] + [math.inf] * batch
    last = [0] * (batch + 1)
    for total in range(1, batch + 1):
        for size in range(1, total + 1):
            cost = best[total - size] + seconds_per_size[size - 1]
            if cost < best[total]:
                best[total], last[total] = cost, size
    sizes, at = [], batch
    while at:
        sizes.append(last[at])
        at -= last[at]
    return tuple(sorted(sizes, reverse=True))


def solve_batch_and_tokens(latency_of_batch: Callable[[int], TokenLatency], batch: int,
                           stages: int, granularity: int = 1,
                           epsilon: float = 0.0) -> BatchTokenSlicing:
    """Run the token DP for every batch-slice size b = 1..batch (`latency_of_batch(b)`: the
    latency model of b sequences at once), then split the batch by `split_batch`."""
    if batch < 1:
        raise PassError(f"batch={batch}: give at least 1 sequence")
    started = time.perf_counter()
    per_size = [solve_token_slices(latency_of_batch(b), stages, granularity, epsilon)
                for b in range(1, batch + 1)]
    sizes = split_batch([r.est_seconds for r in per_size])
    return BatchTokenSlicing(sizes, tuple(per_size[b - 1].slices for b in sizes),
                             sum(per_size[b - 1].est_seconds for b in sizes),
                             time.perf_counter() - started)


# --- the pass ---------------------------------------------------------------------------------

_ATTENTION = ("attention", "attention_with_lse")


@register_pass("slice-tokens")
@dataclass
class SliceTokens(GraphPass):
    """Slice a causal LM's sequence into token slices for a pipeline of `stages` identical stages
    (TeraPipe). Records `token_slices=(...)` in the graph's attrs and sets a `TokenSlicing`
    result. The latency model is `transformer_latency` on the cluster, with the hidden size,
    heads and layers read off the graph's causal attention (the MLP's width is an option)."""

    seq_len: int = 0  # 0: the causal attention's sequence length
    stages: int = 2
    granularity: int = 1
    epsilon: float = 0.0  # seconds
    cluster: str = "dgx-a100"
    dtype: str = "fp32"
    ffn: int = 0  # the MLP's width; 0: 4 x hidden (GPT)

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise PassError(f"stages={self.stages}: give at least 1")
        if self.granularity < 1:
            raise PassError(f"granularity={self.granularity}: give a positive number of tokens")
        if self.epsilon < 0:
            raise PassError(f"epsilon={self.epsilon}: give a number >= 0 (seconds)")
        get_cluster(self.cluster).peak_flops(self.dtype)

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        latency = self.latency_of(graph)
        result = solve_token_slices(latency, self.stages, self.granularity, self.epsilon)
        graph.attrs["token_slices"] = result.slices
        ctx.set_result(result)
        return True

    def latency_of(self, graph: Graph) -> TokenLatency:
        causal = [n for n in graph.nodes if n.op in _ATTENTION and n.attrs.get("causal")]
        if not causal:
            raise PassError(
                f"graph @{graph.name} has no causal attention, so it has no sequence dimension "
                "to slice: slice-tokens needs a causal language model (attention with "
                "causal=True, e.g. is_causal=True in scaled_dot_product_attention)")
        q = causal[0].input_values[0].type.shape  # [batch, heads, seq, head_dim]
        _, heads, seq, head_dim = q
        seq_len = self.seq_len or seq
        if seq_len != seq:
            raise PassError(f"seq_len={self.seq_len} but the causal attention of graph "
                            f"@{graph.name} runs over {seq} tokens; leave seq_len out or give "
                            f"{seq}")
        if self.granularity > seq_len or seq_len % self.granularity:
            raise PassError(f"granularity={self.granularity} does not divide the sequence "
                            f"length {seq_len}; choose a divisor of it (e.g. 1 or 8)")
        layers = len(causal)
        if layers % self.stages:
            raise PassError(f"stages={self.stages} does not divide the {layers} attention layers "
                            f"of graph @{graph.name}; token slicing assumes identical stages")
        hidden = heads * head_dim
        ffn = self.ffn or 4 * hidden
        cluster = get_cluster(self.cluster)
        return transformer_latency(seq_len, hidden, heads, ffn, layers // self.stages,
                                   cluster.peak_flops(self.dtype), itemsize=4,
                                   send_bandwidth=cluster.intra_node_bandwidth,
                                   send_latency=cluster.intra_node_latency)

