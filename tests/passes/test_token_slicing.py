"""Token slicing (TeraPipe): the latency model, the DP against brute force, and the pass."""

import itertools
import math

import numpy as np
import pytest

from graphpar.capture import capture_inference
from graphpar.cost.cluster import get_cluster
from graphpar.cost.compute import SKINNY_ROWS, Roofline
from graphpar.errors import PassError, UsageError
from graphpar.ir.cluster import COMPUTE_CLASSES, ComputeRate
from graphpar.ir.parser import parse_program
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


def brute_force(latency: TokenLatency, stages: int, granularity: int = 1,
                repeats: int = 1) -> float:
    """The best of Eq. 2.5 over every slicing (2^(units-1) of them), from a table of t(k, c)."""
    units = latency.seq_len // granularity
    t = [[latency(k * granularity, c * granularity) if k + c <= units else math.inf
          for c in range(units + 1)] for k in range(units + 1)]
    best = math.inf
    for parts in compositions(units):
        times, context = [], 0
        for k in parts:
            times.append(t[k][context])
            context += k
        best = min(best, repeats * sum(times) + (stages - 1) * max(times))
    return best


def random_latency(rng, seq_len: int, flat: bool) -> TokenLatency:
    base = np.concatenate([[0.0], rng.uniform(0.1, 2.0, seq_len)])
    if rng.random() < 0.5:  # growing with length, as real ones do
        base = np.concatenate([[0.0], np.cumsum(rng.uniform(0.0, 1.0, seq_len)) + 0.5])
    ctx = (0.0, 0.0, 0.0, 0.0) if flat else tuple(rng.uniform(0.0, 0.3, 4))
    return TokenLatency(tuple(base), ctx)


def test_dp_equals_brute_force_over_all_slicings():
    rng = np.random.default_rng(0)
    for case in range(312):
        # up to 16 tokens (32768 slicings) for the last few cases, up to 10 before
        seq_len = int(rng.integers(13, 17)) if case >= 300 else int(rng.integers(1, 11))
        latency = random_latency(rng, seq_len, flat=case % 3 == 0)
        stages = int(rng.integers(1, 6))
        got = solve_token_slices(latency, stages)
        assert sum(got.slices) == latency.seq_len
        assert got.est_seconds == pytest.approx(pipeline_seconds(latency, got.slices, stages),
                                                rel=1e-12)
        assert got.est_seconds == pytest.approx(brute_force(latency, stages), rel=1e-12), case


def test_epsilon_gap_stays_within_stages_times_epsilon():
    rng = np.random.default_rng(1)
    evaluated_less = False
    for case in range(156):
        seq_len = int(rng.integers(13, 17)) if case >= 150 else int(rng.integers(2, 11))
        latency = random_latency(rng, seq_len, flat=case % 3 == 0)
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


def test_dp_slices_a_gpt3_13b_stage_of_8192_tokens_one_token_at_a_time():
    # The size: L = 8192 at granularity 1 with epsilon 0 (exact). The bounds search
    # and the pushed DP keep it to a few hundred DP runs over short slices.
    latency = transformer_latency(8192, 5120, 40, 20480, 1, 125e12, itemsize=2,
                                  send_bandwidth=300e9, send_latency=10e-6, overhead=2e-4)
    got = solve_token_slices(latency, stages=40)
    assert sum(got.slices) == 8192 and got.gap_bound_seconds == 0.0
    assert got.est_seconds == pytest.approx(pipeline_seconds(latency, got.slices, 40), rel=1e-12)
    assert list(got.slices) == sorted(got.slices, reverse=True)  # long first, short last
    coarse = solve_token_slices(latency, stages=40, granularity=8)
    assert got.est_seconds <= coarse.est_seconds  # the unit grid holds every multiple of 8
    assert got.est_seconds < pipeline_seconds(latency, [8192], 40) / 10


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


def _roofline(peak, bandwidth=math.inf, overhead=0.0, skinny_bandwidth=None):
    """Every class at `peak` FLOP/s and `bandwidth`; `gemm_skinny` at `skinny_bandwidth`."""
    rate = ComputeRate(peak, bandwidth, overhead)
    skinny = ComputeRate(peak, skinny_bandwidth or bandwidth, overhead)
    return Roofline(tuple((c, skinny if c == "gemm_skinny" else rate) for c in COMPUTE_CLASSES))


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


def test_transformer_latency_batch_tensor_parallel_roofline_and_all_reduces():
    h, f, peak, bw = 64, 256, 1e12, 1e9
    weights = 4 * h * h + 2 * h * f
    plain = transformer_latency(64, h, 4, f, 1, peak)
    # b sequences: b times the FLOPs, the context term too
    double = transformer_latency(64, h, 4, f, 1, peak, batch=2)
    assert double(8, 16) == pytest.approx(2 * plain(8, 16), rel=1e-12)
    # m-way tensor parallel: 1/m of the FLOPs plus 4 ring all-reduces of the slice's activations
    tp = transformer_latency(64, h, 4, f, 1, peak, tensor_parallel=4, allreduce_bandwidth=bw,
                             allreduce_latency=1e-6)
    ring = 4 * (2 * 3 * 1e-6 + 2 * 3 / 4 * 8 * h * 4 / bw)
    assert tp(8, 16) == pytest.approx(plain(8, 16) / 4 + ring, rel=1e-12)
    # the roofline: a slice never takes less than reading the weights, forward and backward
    slow_memory = transformer_latency(64, h, 4, f, 1, _roofline(peak, bandwidth=1e9))
    floor = BACKWARD_FACTOR * weights * 4 / 1e9
    assert slow_memory(1, 0) == pytest.approx(floor + plain(1, 0) - BACKWARD_FACTOR * 2 *
                                              weights / peak, rel=1e-12)
    # 1 and 2 tokens both wait on memory: only attention's FLOPs tell them apart
    assert slow_memory(2, 0) - slow_memory(1, 0) == pytest.approx(
        BACKWARD_FACTOR * 4 * h * (3 - 1) / peak, rel=1e-9)


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


def test_batch_and_tokens_pick_the_best_equal_batch_split_against_brute_force():
    # A fixed cost per slice favours big batch slices, the fill and drain small ones.
    def latency(b):
        return TokenLatency(tuple([0.0] + [2.0 + 0.5 * b * length for length in range(1, 9)]),
                            (0.0, 0.0, 0.0, 0.05 * b))
    for stages in (1, 3, 8):
        got = solve_batch_and_tokens(latency, batch=4, stages=stages)
        best = min(brute_force(latency(b), stages, repeats=4 // b) for b in (1, 2, 4))
        assert got.est_seconds == pytest.approx(best, rel=1e-12)
        (size,) = set(got.batch_slices)
        assert size * len(got.batch_slices) == 4 and len(set(got.token_slices)) == 1
        assert got.est_seconds == pytest.approx(pipeline_seconds(
            latency(size), got.token_slices[0], stages, repeats=4 // size), rel=1e-12)
    # many stages: small batch slices shorten the fill and drain
    assert solve_batch_and_tokens(latency, batch=4, stages=8).batch_slices == (1, 1, 1, 1)


def test_repeated_slicings_equal_brute_force():
    rng = np.random.default_rng(5)
    for case in range(40):
        latency = random_latency(rng, int(rng.integers(1, 10)), flat=case % 2 == 0)
        stages, repeats = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        got = solve_token_slices(latency, stages, repeats=repeats)
        assert got.est_seconds == pytest.approx(brute_force(latency, stages, repeats=repeats),
                                                rel=1e-12)


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
        transformer_latency(32, 64, 4, 256, 1, Roofline.of(cpu, "fp32"),
                            send_bandwidth=cpu.intra_node_bandwidth,
                            send_latency=cpu.intra_node_latency, batch=2), 2, granularity=4)
    # At this width the per-call overhead outweighs what slicing saves: the DP keeps one slice
    # (by FLOPs alone it cut several); the pass must record the DP's answer either way.
    assert result.slices == expected.slices
    assert math.isclose(result.est_seconds, expected.est_seconds, rel_tol=1e-12)
    assert result.batch_slices == (2,)  # the example's batch of 2, one microbatch
    assert result.est_unsliced_seconds >= result.est_seconds
    assert graph.attrs["token_slices"] == result.slices
    text = print_graph(graph)
    slices = ", ".join(map(str, result.slices))
    assert f"token_slices=[{slices}]" in text and "batch_slices=[2]" in text
    (parsed,) = parse_program(text)
    assert parsed.attrs["token_slices"] == result.slices


def test_pass_with_a_slice_count_cuts_equal_slices(gpt):
    graph = gpt.copy()
    result = run(graph, "stages=2,slices=3,cluster=cpu")
    assert result.slices == (11, 11, 10) and graph.attrs["token_slices"] == (11, 11, 10)
    with pytest.raises(PassError, match="slices=40: the sequence has only 32 tokens"):
        run(gpt.copy(), "slices=40")


def test_pass_refuses_graphs_it_cannot_slice(gpt):
    mlp = get_model("mlp", "tiny")
    graph = capture_inference(mlp.module, mlp.inputs, name="mlp").graph
    with pytest.raises(PassError, match="no causal attention, so it has no sequence dimension"):
        run(graph, "stages=2")
    bert = get_model("bert", "tiny")
    graph = capture_inference(bert.module, bert.inputs, name="bert").graph
    with pytest.raises(PassError, match=r"graph @bert: node \d+ \(attention\) at .*\.py:\d+ in "
                       r".* is not causal \(it has neither is_causal=True nor a mask\)"):
        run(graph, "stages=2")
    with pytest.raises(PassError, match="seq_len=30 but the causal attention"):
        run(gpt, "seq_len=30")
    with pytest.raises(PassError, match="stages=3 does not divide the 2 attention layers"):
        run(gpt, "stages=3")
    with pytest.raises(UsageError, match="granularity=0"):
        parse_pipeline("slice-tokens{granularity=0}")


def test_transformer_latency_prices_skinny_slices_and_calls_by_the_roofline():
    h, f, peak = 64, 256, 1e12
    weights = 4 * h * h + 2 * h * f
    plain = transformer_latency(64, h, 4, f, 1, peak)
    # up to SKINNY_ROWS rows (batch x tokens) the matmuls read weights at the skinny bandwidth
    roof = _roofline(peak, skinny_bandwidth=1e9)
    skinny = transformer_latency(64, h, 4, f, 1, roof, batch=2)
    double = transformer_latency(64, h, 4, f, 1, peak, batch=2)
    rows = SKINNY_ROWS // 2
    assert skinny(rows, 0) == pytest.approx(
        double(rows, 0) + BACKWARD_FACTOR * (weights * 4 / 1e9 - 2 * 2 * rows * weights / peak),
        rel=1e-9)
    assert skinny(rows + 1, 0) == pytest.approx(double(rows + 1, 0), rel=1e-12)
    # a per-call overhead: six projection matmuls and one attention per layer, x3 with backward
    slow_calls = transformer_latency(64, h, 4, f, 1, _roofline(peak, overhead=1e-5))
    assert slow_calls(8, 3) - plain(8, 3) == pytest.approx(BACKWARD_FACTOR * 7 * 1e-5, rel=1e-9)
