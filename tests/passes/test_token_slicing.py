"""Token slicing (TeraPipe): the latency model, the DP against brute force, and the pass."""

import itertools
import math

import numpy as np
import pytest

from graphpar.capture import capture_inference
from graphpar.cost.cluster import get_cluster
from graphpar.errors import PassError, UsageError
from graphpar.ir.printer import print_graph
from graphpar.models import get_model
from graphpar.passes import PassContext, PassManager, parse_pipeline
from graphpar.passes.pipeline.token_slicing import (
    BACKWARD_FACTOR,
    TokenLatency,
    TokenSlicing,
    fit,
    pipeline_seconds,
    solve_batch_and_tokens,
    solve_token_slices,
    split_batch,
    transformer_latency,
)


def compositions(n: int):
    """Every way to write n as an ordered sum of positive parts."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        parts, run = [], 1
        for cut in cuts:
            if cut:
                parts.append(run)
                run = 0
            run += 1
        yield parts + [run]


def brute_force(latency: TokenLatency, stages: int, granularity: int = 1) -> float:
    units = latency.seq_len // granularity
    return min(pipeline_seconds(latency, [k * granularity for k in parts], stages)
               for parts in compositions(units))


def random_latency(rng, seq_len: int, flat: bool) -> TokenLatency:
    base = np.concatenate([[0.0], rng.uniform(0.1, 2.0, seq_len)])
    if rng.random() < 0.5:  # growing with length, as real ones do
        base = np.concatenate([[0.0], np.cumsum(rng.uniform(0.0, 1.0, seq_len)) + 0.5])
    ctx = (0.0, 0.0, 0.0, 0.0) if flat else tuple(rng.uniform(0.0, 0.3, 4))
    return TokenLatency(tuple(base), ctx)


def test_dp_equals_brute_force_over_all_slicings():
    rng = np.random.default_rng(0)
    for case in range(300):
        latency = random_latency(rng, int(rng.integers(1, 10)), flat=case % 3 == 0)
        stages = int(rng.integers(1, 6))
        got = solve_token_slices(latency, stages)
        assert sum(got.slices) == latency.seq_len
        assert got.est_seconds == pytest.approx(pipeline_seconds(latency, got.slices, stages),
                                                rel=1e-12)
        assert got.est_seconds == pytest.approx(brute_force(latency, stages), rel=1e-12), case


def test_epsilon_gap_stays_within_stages_times_epsilon():
    rng = np.random.default_rng(1)
    evaluated_less = False
    for case in range(150):
        latency = random_latency(rng, int(rng.integers(2, 10)), flat=case % 3 == 0)
        stages = int(rng.integers(1, 6))
        epsilon = float(rng.uniform(0.05, 1.0))
        exact = brute_force(latency, stages)
        got = solve_token_slices(latency, stages, epsilon=epsilon)
        assert got.gap_bound_seconds == stages * epsilon
        assert exact - 1e-12 <= got.est_seconds <= exact + stages * epsilon + 1e-12
        evaluated_less |= got.evaluated < solve_token_slices(latency, stages).evaluated
    assert evaluated_less  # the gap does prune bounds


def test_granularity_gives_multiples_and_the_optimum_over_them():
    rng = np.random.default_rng(2)
    for _ in range(40):
        latency = random_latency(rng, 8 * int(rng.integers(1, 8)), flat=False)
        stages = int(rng.integers(1, 5))
        got = solve_token_slices(latency, stages, granularity=8)
        assert all(length % 8 == 0 and length > 0 for length in got.slices)
        assert sum(got.slices) == latency.seq_len
        assert got.est_seconds == pytest.approx(brute_force(latency, stages, 8), rel=1e-12)


def test_flat_cost_gives_equal_slices_and_context_cost_puts_long_slices_first():
    # t(l, c) = 1 + l (a fixed cost per slice): no context cost, so the slices are equal.
    flat = TokenLatency(tuple([0.0] + [1.0 + length for length in range(1, 97)]),
                        (0.0, 0.0, 0.0, 0.0))
    even = solve_token_slices(flat, stages=8).slices
    assert len(even) > 1 and max(even) - min(even) <= 1
    # The same with a growing context cost: later slices see more context, so they are shorter.
    ctx = TokenLatency(flat.base, (0.0, 0.0, 0.0, 0.02))
    slices = solve_token_slices(ctx, stages=8).slices
    assert len(slices) > 2
    assert list(slices) == sorted(slices, reverse=True) and slices[0] > slices[-1]


def test_transformer_latency_counts_the_layer_flops():
    h, f, layers, peak = 64, 256, 3, 1e12
    model = transformer_latency(128, h, 4, f, layers, peak)
    per_flop = BACKWARD_FACTOR * layers / peak
    # one token, no context: projections 2 (4 h^2 + 2 h f) + attention to itself 4 h
    assert model(1, 0) == pytest.approx((2 * (4 * h * h + 2 * h * f) + 4 * h) * per_flop,
                                        rel=1e-12)
    # 10 tokens after 20: 4 h l c more than without the context
    assert model(10, 20) - model(10, 0) == pytest.approx(4 * h * 10 * 20 * per_flop, rel=1e-12)
    assert model.ctx[:3] == (0.0, 0.0, 0.0)


def test_fit_recovers_the_model_and_reports_its_error_on_held_back_points():
    true = TokenLatency(tuple([0.0] + [0.5 + 0.01 * length for length in range(1, 65)]),
                        (0.02, 0.001, 0.003, 0.0005))
    points = [(length, 0, true(length, 0)) for length in range(1, 65, 4)]
    points += [(length, c, true(length, c)) for length in (1, 8, 16, 33, 64)
               for c in (8, 17, 32, 48) if length + c <= 64]
    got = fit(points, seq_len=64)
    assert got.ctx == pytest.approx(true.ctx, rel=1e-6, abs=1e-9)
    assert got.fit_error == pytest.approx(0.0, abs=1e-9)
    rng = np.random.default_rng(3)
    noisy = [(length, c, t * (1 + rng.uniform(-0.01, 0.01))) for length, c, t in points]
    assert fit(noisy, seq_len=64).fit_error < 0.02  # 1 % noise: about 1 % error held back


def partitions(n: int, most: int | None = None):
    """Every multiset of positive sizes summing to n, sizes descending."""
    most = n if most is None else most
    if n == 0:
        yield ()
    for first in range(min(n, most), 0, -1):
        for rest in partitions(n - first, first):
            yield (first,) + rest


def test_batch_split_is_the_best_partition():
    rng = np.random.default_rng(4)
    for _ in range(100):
        seconds = rng.uniform(0.1, 3.0, int(rng.integers(1, 9)))
        got = split_batch(seconds)
        assert sum(got) == len(seconds)
        best = min(sum(seconds[b - 1] for b in p) for p in partitions(len(seconds)))
        assert sum(seconds[b - 1] for b in got) == pytest.approx(best, rel=1e-12)


def test_batch_and_tokens_run_the_token_dp_per_batch_slice_size():
    # A fixed cost per slice favours whole batches; the token DP then slices each one.
    def latency(b):
        return TokenLatency(tuple([0.0] + [2.0 + 0.5 * b * length for length in range(1, 17)]),
                            (0.0, 0.0, 0.0, 0.01 * b))
    got = solve_batch_and_tokens(latency, batch=4, stages=4, granularity=4)
    per_size = [solve_token_slices(latency(b), 4, 4).est_seconds for b in range(1, 5)]
    best = min(sum(per_size[b - 1] for b in p) for p in partitions(4))
    assert got.est_seconds == pytest.approx(best, rel=1e-12)
    assert sum(got.batch_slices) == 4
    for b, slices in zip(got.batch_slices, got.token_slices):
        assert slices == solve_token_slices(latency(b), 4, 4).slices


def test_bad_arguments_are_clear_errors():
    latency = TokenLatency((0.0, 1.0, 2.0, 3.0), (0.0, 0.0, 0.0, 0.0))
    with pytest.raises(PassError, match="granularity=2 does not divide"):
        solve_token_slices(latency, 2, granularity=2)
    with pytest.raises(PassError, match="stages=0"):
        solve_token_slices(latency, 0)
    with pytest.raises(PassError, match="context 0"):
        fit([(1, 1, 1.0)] * 6, seq_len=3)


@pytest.fixture(scope="module")
def gpt():
    ex = get_model("gpt", "tiny")  # 2 layers, 4 heads of 16, sequence 32
    return capture_inference(ex.module, ex.inputs, name="gpt").graph


def run(graph, options: str) -> TokenSlicing:
    ctx = PassContext()
    PassManager(parse_pipeline(f"slice-tokens{{{options}}}")).run(graph, ctx)
    return ctx.result(TokenSlicing)


def test_pass_records_the_dp_slices_in_the_graph(gpt):
    graph = gpt.copy()
    result = run(graph, "stages=2,granularity=4,cluster=cpu")
    cpu = get_cluster("cpu")
    expected = solve_token_slices(
        transformer_latency(32, 64, 4, 256, 1, cpu.peak_flops("fp32"),
                            send_bandwidth=cpu.intra_node_bandwidth,
                            send_latency=cpu.intra_node_latency), 2, granularity=4)
    assert len(result.slices) > 1
    assert result.slices == expected.slices
    assert math.isclose(result.est_seconds, expected.est_seconds, rel_tol=1e-12)
    assert graph.attrs["token_slices"] == result.slices
    header = f"attrs {{token_slices=[{', '.join(map(str, result.slices))}]}}"
    assert header in print_graph(graph)


def test_pass_refuses_graphs_it_cannot_slice(gpt):
    mlp = get_model("mlp", "tiny")
    graph = capture_inference(mlp.module, mlp.inputs, name="mlp").graph
    with pytest.raises(PassError, match="no causal attention, so it has no sequence dimension"):
        run(graph, "stages=2")
    with pytest.raises(PassError, match="seq_len=30 but the causal attention"):
        run(gpt, "seq_len=30")
    with pytest.raises(PassError, match="stages=3 does not divide the 2 attention layers"):
        run(gpt, "stages=3")
    with pytest.raises(UsageError, match="granularity=0"):
        parse_pipeline("slice-tokens{granularity=0}")
