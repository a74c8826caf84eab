"""The §3.1 experiment and Fig. 10 from the M/D/1 formulas, and the simulator against them."""

import math

import numpy as np
import pytest

from graphpar.placement.queueing import (
    alpha_max,
    beta_max,
    md1_latency,
    pipeline_latency,
    simple_latency,
)
from graphpar.placement.simulator import SimGroup, simulate
from graphpar.placement.workload import gamma_workload, synthetic

D = 0.4  # seconds per request on one device (§3.1)


def test_section_3_1_formulas_give_the_papers_latencies():
    assert simple_latency(3.0, D) == pytest.approx(0.70, abs=1e-12)
    assert pipeline_latency(3.0, D, D / 2) == pytest.approx(0.55, abs=1e-12)
    # 20 %/80 %: the pipeline is unchanged; one device is nearly saturated
    assert simple_latency(3.0, D, share=0.2) == pytest.approx(
        0.2 * (D + 0.6 * D**2 / (2 * (1 - 0.24))) + 0.8 * (D + 2.4 * D**2 / (2 * 0.04)))
    assert md1_latency(3.0, D) == math.inf


def _section_3_1(shares, cv, seconds=20000.0):
    w = synthetic(["a", "b"], [3.0 * s for s in shares], cv, seconds, seed=3)
    simple = simulate([SimGroup({"a": [D]}), SimGroup({"b": [D]})], w, warmup=100)
    pipe = simulate([SimGroup({"a": [D / 2, D / 2], "b": [D / 2, D / 2]})], w, warmup=100)
    return simple.mean_latency, pipe.mean_latency


def test_the_simulator_reproduces_section_3_1_within_3_percent():
    simple, pipe = _section_3_1([0.5, 0.5], 1.0)
    assert simple == pytest.approx(0.70, rel=0.03)
    assert pipe == pytest.approx(0.55, rel=0.03)


def test_burstier_or_skewed_load_widens_the_pipelines_lead():
    """The paper measures 1.9x at CV=3 and 6.6x at a 20/80 split (against 1.3x at CV=1)."""
    simple, pipe = _section_3_1([0.5, 0.5], 3.0)
    assert simple / pipe > 1.5
    simple, pipe = _section_3_1([0.2, 0.8], 1.0, seconds=60000.0)
    assert simple / pipe > 4.0


def test_fig10_limits_match_the_digest_table_and_solve_the_equality():
    table = {0.01: (1.001, 1.413), 0.25: (1.033, 1.376), 0.5: (1.069, 1.333),
             1.0: (1.132, 1.236), 1.5: (1.111, 1.123), 1.99: (1.003, 1.003)}
    for u, (a, b) in table.items():
        assert alpha_max(u) == pytest.approx(a, abs=1e-3)
        assert beta_max(u) == pytest.approx(b, abs=1e-3)
        lam = u / D
        # at the limit the pipeline's latency equals the simple placement's
        assert pipeline_latency(lam, alpha_max(u) * D, alpha_max(u) * D / 2) == pytest.approx(
            simple_latency(lam, D), rel=1e-9)
        assert pipeline_latency(lam, D, beta_max(u) * D / 2) == pytest.approx(
            simple_latency(lam, D), rel=1e-9)


def test_gamma_arrivals_have_the_asked_rate_and_cv():
    w = gamma_workload(["a"], 50.0, 3.0, 4000.0, seed=1)
    gaps = np.diff(w.arrivals)
    assert w.rate() == pytest.approx(50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.05)
