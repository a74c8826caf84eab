"""The cost model's fits: noiseless times made by the formulas give their coefficients back
exactly; noisy ones leave residuals that say so."""

import numpy as np
import pytest
import torch

from graphpar.calibration.fit import fit_alpha_beta, fit_roofline, nnls, roofline_seconds
from graphpar.cost.communication import collective_time
from graphpar.errors import ClusterSpecError

# (M, K, N) matmuls: skinny ones below the ridge (memory-bound), square ones above it
SHAPES = [(1, 1024, 1024), (4, 2048, 2048), (16, 256, 256), (32, 512, 512), (128, 1024, 1024),
          (512, 1024, 1024)]
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


def _matmul(m, k, n):
    return 2 * m * k * n, 4 * (m * k + k * n + m * n)


def test_nnls_keeps_coefficients_non_negative():
    design = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nnls(design, np.array([2.0, 3.0, 5.0])) == pytest.approx([2.0, 3.0])
    # the unconstrained answer has x[1] < 0; the constrained one sets it to 0
    assert nnls(design, np.array([2.0, -3.0, -1.0])) == pytest.approx([1.0 / 2 * (2 - 1), 0.0])


def test_roofline_fit_recovers_rate_bandwidth_and_overhead_from_both_regimes():
    rate, bandwidth, overhead = 90e9, 12e9, 3e-6
    samples = [(f, b, roofline_seconds(f, b, rate, bandwidth, overhead))
               for f, b in map(lambda s: _matmul(*s), SHAPES)]
    intensities = [f / b for f, b, _ in samples]
    assert min(intensities) < rate / bandwidth < max(intensities)  # both regimes are there
    fit = fit_roofline(samples)
    assert fit.flops == pytest.approx(rate, rel=1e-9)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert fit.overhead == pytest.approx(overhead, rel=1e-6)
    assert max(map(abs, fit.residuals)) < 1e-9


def test_roofline_fit_of_a_memory_bound_class_has_no_flop_rate():
    """Elementwise ops never reach the arithmetic roof: F is not measured, not invented."""
    bandwidth, overhead = 20e9, 2e-6
    samples = [(n, 12 * n, 12 * n / bandwidth + overhead) for n in (2**10, 2**14, 2**18, 2**22)]
    fit = fit_roofline(samples)
    assert fit.flops is None
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert fit.overhead == pytest.approx(overhead, rel=1e-6)


def test_roofline_residuals_report_noise_in_the_callers_order():
    rate, bandwidth = 50e9, 10e9
    samples = [(f, b, max(f / rate, b / bandwidth)) for f, b in map(lambda s: _matmul(*s), SHAPES)]
    slow = list(samples)
    slow[2] = (slow[2][0], slow[2][1], slow[2][2] * 3)  # one shape ran three times slower
    fit = fit_roofline(slow)
    assert max(map(abs, fit.residuals)) > 0.05  # no roofline passes through that point
    backwards = fit_roofline(slow[::-1])
    assert backwards.residuals == pytest.approx(fit.residuals[::-1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ranks", [(2,), (4,), (2, 4, 8)])
def test_alpha_beta_fit_recovers_each_collective_formula(kind, ranks):
    latency, bandwidth = 300e-6, 1.3e9
    samples = [(kind, n, m, collective_time(kind, m, n, bandwidth, latency))
               for n in ranks for m in (256, 4096, 65536, 2**20, 2**24)]
    fit = fit_alpha_beta(samples)
    assert fit.latency == pytest.approx(latency, rel=1e-9)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert max(map(abs, fit.residuals)) < 1e-9
    # plugged back into the cost model's formula, the fit reproduces the measurements
    for (k, n, m, seconds) in samples:
        assert collective_time(k, m, n, fit.bandwidth, fit.latency) == pytest.approx(seconds)


def test_one_link_fit_over_every_kind_at_once():
    latency, bandwidth = 40e-6, 5e9
    samples = [(k, n, m, collective_time(k, m, n, bandwidth, latency))
               for k in KINDS for n in (2, 4) for m in (1024, 2**20)]
    fit = fit_alpha_beta(samples)
    assert (fit.latency, fit.bandwidth) == (pytest.approx(latency), pytest.approx(bandwidth))


def test_alpha_beta_fit_says_when_time_does_not_grow_with_size():
    fit = fit_alpha_beta([("all_reduce", 2, m, 1e-3) for m in (256, 4096, 2**20)])
    assert fit.bandwidth is None and fit.latency == pytest.approx(0.5e-3)


def test_a_fit_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        fit_roofline([(1.0, 1.0, 1.0)])
    with pytest.raises(ValueError, match="at least 2"):
        fit_alpha_beta([("all_reduce", 2, 256, 1e-4)])


def test_roofline_with_a_measured_overhead_keeps_it_and_fits_the_rates():
    """Large shapes alone cannot tell 30 us per call from a slightly slower rate: one shape
    running 15% fast makes the free fit drop the overhead to 0. Given the per-call time
    measured on tiny calls, the fit keeps it and fits the rates to the rest."""
    rate, overhead = 72e9, 30e-6
    samples = []
    for i, (m, k, n) in enumerate([(256, 1024, 1024), (512, 1024, 1024), (128, 512, 1024),
                                   (64, 512, 512)]):
        flops, nbytes = _matmul(m, k, n)
        samples.append((flops, nbytes, (flops / rate + overhead) * (0.85 if i == 3 else 1)))
    assert fit_roofline(samples).overhead == 0.0  # the mispricing the measured overhead fixes
    fit = fit_roofline(samples, overhead=overhead)
    assert fit.overhead == overhead
    assert fit.flops == pytest.approx(rate, rel=0.05)


def test_roofline_with_a_measured_overhead_recovers_the_rates_exactly():
    """Noiseless times: the true overhead gives the rates back exactly; a slow path among
    large shapes cannot turn into milliseconds of overhead."""
    rate, bandwidth, overhead = 90e9, 12e9, 40e-6
    samples = [(f, b, roofline_seconds(f, b, rate, bandwidth, overhead))
               for f, b in map(lambda s: _matmul(*s), SHAPES)]
    fit = fit_roofline(samples, overhead=overhead)
    assert (fit.overhead, fit.flops, fit.bandwidth) == (
        overhead, pytest.approx(rate, rel=1e-9), pytest.approx(bandwidth, rel=1e-9))
    assert max(map(abs, fit.residuals)) < 1e-9
    slow = samples[:-1] + [(samples[-1][0], samples[-1][1], samples[-1][2] * 2)]
    assert fit_roofline(slow, overhead=overhead).overhead == overhead
    with pytest.raises(ValueError, match="overhead must be >= 0"):
        fit_roofline(samples, overhead=-1.0)


def test_in_step_factors_are_ratios_of_sums_and_dispatch_the_rest():
    """Each class's factor is its nodes' measured time over their estimate, summed (so its
    share of a step comes out right); the step's time outside priced nodes, spread over them,
    is the dispatch; the corrected estimate of each program is then its step exactly."""
    from graphpar.calibration.fit import fit_in_step

    train = [("gemm", 1e-3, 1.5e-3), ("gemm", 3e-3, 4.5e-3), ("elementwise", 1e-4, 3e-4),
             ("all_reduce", 2e-3, 5e-3), ("free", 0.0, 2e-5)]
    decode = [("gemm_skinny", 5e-4, 1e-3), ("elementwise", 1e-4, 3e-4)]
    dispatch = 1e-5
    steps = [sum(m for _, _, m in nodes) + dispatch * sum(p > 0 for _, p, _ in nodes)
             for nodes in (train, decode)]
    steps[0] -= 2e-5  # the free node's 20 us is part of the step's dispatch time
    fit = fit_in_step([(train, steps[0]), (decode, steps[1])])
    assert fit.factors == pytest.approx({"gemm": 1.5, "elementwise": 3.0, "all_reduce": 2.5,
                                         "gemm_skinny": 2.0})
    assert fit.dispatch == pytest.approx(dispatch)
    assert fit.residuals == pytest.approx((0, 0), abs=1e-12)
    # factors are clipped: a node measured at nothing does not make its class free
    assert fit_in_step([([("gemm", 1e-3, 0.0)], 1e-3)]).factors["gemm"] == 0.25
    with pytest.raises(ValueError, match="at least one profiled program"):
        fit_in_step([])


def test_in_step_collectives_split_latency_from_bandwidth():
    """In a step a small collective pays most for waking its peer: the fit gives each kind a
    latency factor and a bandwidth factor, from its nodes' two terms, exactly on exact data."""
    from graphpar.calibration.fit import fit_in_step

    nodes = [("all_reduce", a + b, 3.0 * a + 1.2 * b, (a, b))
             for a, b in ((2e-4, 1e-4), (2e-4, 1e-3), (2e-4, 8e-3), (4e-4, 2e-3))]
    step = sum(m for _, _, m, _ in nodes)
    fit = fit_in_step([(nodes, step)])
    assert fit.collectives["all_reduce"] == pytest.approx((3.0, 1.2))
    assert fit.dispatch == pytest.approx(0, abs=1e-12)
    assert fit.residuals == pytest.approx((0,), abs=1e-9)
    # the ratio of sums is still reported beside
    assert fit.factors["all_reduce"] == pytest.approx(step / sum(p for _, p, _, _ in nodes))


def test_in_step_dispatch_splits_into_time_per_node_and_per_result_byte():
    """Two programs of the same nodes, one on tensors 16x larger: the time between nodes
    grows with the bytes of their results (fresh memory), and the fit tells that from a time
    per node exactly on exact data; one program alone puts it all per node."""
    from graphpar.calibration.fit import fit_in_step

    per_node, per_byte = 5e-6, 4e-11
    programs = []
    for scale in (1, 16):
        nodes = [("gemm", 1e-4 * scale, 1e-4 * scale), ("elementwise", 1e-5 * scale,
                                                        3e-5 * scale)] * 50
        result_bytes = 100 * 2**16 * scale
        step = sum(m for _, _, m in nodes) + per_node * len(nodes) + per_byte * result_bytes
        programs.append((nodes, step, result_bytes))
    fit = fit_in_step(programs)
    assert (fit.dispatch, fit.dispatch_per_byte) == (pytest.approx(per_node),
                                                     pytest.approx(per_byte))
    assert fit.residuals == pytest.approx((0, 0), abs=1e-9)
    one = fit_in_step(programs[1:])
    assert one.dispatch_per_byte == 0
    assert one.dispatch == pytest.approx(per_node + per_byte * 100 * 2**20 / 100)


def test_the_roofline_charges_a_node_its_result_bytes_at_the_cluster_s_rate():
    from graphpar.cost.cluster import cluster_from_dict, get_cluster
    from graphpar.cost.compute import Roofline, op_seconds
    from graphpar.ir.types import TensorType

    base = get_cluster("cpu")
    fresh = cluster_from_dict({"base": "cpu", "seconds_per_result_byte": 1e-10})
    x = TensorType((256, 256), torch.float32)
    plain = op_seconds("add", [x, x], [x], {}, Roofline.of(base))
    assert op_seconds("add", [x, x], [x], {}, Roofline.of(fresh)) == pytest.approx(
        plain + 1e-10 * x.nbytes)
    assert cluster_from_dict(fresh.to_dict()).seconds_per_result_byte == 1e-10
    with pytest.raises(ClusterSpecError, match="seconds_per_result_byte"):
        cluster_from_dict({"base": "cpu", "seconds_per_result_byte": -1})
