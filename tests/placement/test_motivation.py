"""AlpaServe §3.2 on the simulator: 8 devices, 8 models of 0.4 s (the 2.6B shape), two
replicas per model (two models per device, 13 GB) against one 8-stage pipeline holding all
eight. Model parallelism wins most at high CV and tight SLO; with an overhead (α: each stage
takes αL/8) replication wins back the loose SLOs."""

import pytest

from graphpar.placement.simulator import SimGroup, simulate
from graphpar.placement.workload import gamma_workload

NAMES = [f"m{i}" for i in range(8)]
L = 0.4
REPLICATED = [SimGroup({NAMES[d]: [L], NAMES[(d + 1) % 8]: [L]}) for d in range(8)]


def _gap(rate, cv, scale, alpha=1.0):
    """Attainment of the pipeline minus replication's."""
    w = gamma_workload(NAMES, rate, cv, 1000.0, seed=1)
    pipeline = [SimGroup({n: [alpha * L / 8] * 8 for n in NAMES})]
    mp = simulate(pipeline, w, scale * L, warmup=10).attainment
    return mp - simulate(REPLICATED, w, scale * L, warmup=10).attainment


def test_model_parallelism_helps_most_with_bursty_requests():
    assert _gap(20, 8.0, 5) > _gap(20, 2.0, 5) > _gap(20, 0.5, 5) >= -0.005
    assert _gap(20, 8.0, 5) > 0.2


def test_model_parallelism_helps_most_with_tight_slos():
    assert _gap(30, 3.0, 1.5) > _gap(30, 3.0, 5) > _gap(30, 3.0, 20) >= -0.005
    assert _gap(30, 3.0, 1.5) > 0.1


def test_overhead_hands_loose_slos_back_to_replication():
    assert _gap(30, 3.0, 20, alpha=1.1) < 0 < _gap(30, 3.0, 1.5, alpha=1.1)


@pytest.mark.parametrize("rate", [8, 20])
def test_model_parallelism_helps_at_low_and_moderate_rates(rate):
    assert _gap(rate, 3.0, 5) > 0.05
