"""The placement search: never worse than selective replication, model parallelism winning
where the paper says it does, memory budgets, and errors."""

import numpy as np
import pytest

from graphpar.errors import PlacementError
from graphpar.placement.configs import LayerProfile
from graphpar.placement.place import Problem, place
from graphpar.placement.workload import gamma_workload

# a 0.4 s, 4-layer model of 5.2 GB: the §3.2 shape (per-layer output 1 MB)
LAYERS = (0.1, 0.1, 0.1, 0.1)
PROFILE = LayerProfile("m", LAYERS, (1.3e9,) * 4, (1e6,) * 4)


def _problem(models=4, devices=4, rate=6.0, cv=3.0, scale=5.0, memory=13e9, seed=0,
             seconds=300.0):
    names = [f"m{i}" for i in range(models)]
    w = gamma_workload(names, rate, cv, seconds, seed=seed)
    return Problem({n: PROFILE for n in names}, devices, memory, w,
                   {n: scale * PROFILE.latency for n in names}, warmup=10.0)


@pytest.mark.parametrize("seed,cv,scale", [(0, 1.0, 2.0), (1, 3.0, 5.0), (2, 4.0, 10.0)])
def test_alpaserve_never_loses_to_selective_replication(seed, cv, scale):
    p = _problem(cv=cv, scale=scale, seed=seed)
    sr = place(p, "selective-replication")
    assert place(p, "alpaserve").attainment >= sr.attainment
    assert place(p, "alpaserve-fast").attainment >= 0.9 * sr.attainment


def test_model_parallelism_wins_on_bursty_load_with_a_tight_slo():
    p = _problem(cv=4.0, scale=2.0, memory=6e9)  # one replica of a model per device
    sr, alpa = place(p, "selective-replication"), place(p, "alpaserve")
    assert alpa.attainment > sr.attainment + 0.05
    assert any(g.stages * g.intra > 1 for g in alpa.groups if g.models)


def test_placements_respect_the_memory_budget():
    p = _problem(memory=6e9)
    for policy in ("alpaserve", "selective-replication", "round-robin"):
        for g in place(p, policy).groups:
            per_device = len(g.models) * 5.2e9 / len(g.devices)
            assert per_device <= 6e9 + 1e-3


def test_clockwork_replaces_per_window():
    p = _problem(seconds=120.0)
    cw = place(p, "clockwork++", window=30.0)
    assert len(cw.windows) == 4 and 0.0 <= cw.attainment <= 1.0


def test_impossible_problems_say_why():
    with pytest.raises(PlacementError, match="fits no device group"):
        place(_problem(devices=1, memory=4e9))
    with pytest.raises(PlacementError, match="SLO .* below its fastest"):
        place(_problem(scale=0.1))
    with pytest.raises(PlacementError, match="unknown policy 'fastest'"):
        place(_problem(), "fastest")


def test_a_single_device_per_model_pipeline_matches_section_3_1_attainment():
    """Two models, two devices, no SLO pressure: every policy serves everything."""
    p = _problem(models=2, devices=2, rate=3.0, cv=1.0, scale=100.0)
    assert place(p, "alpaserve").attainment == 1.0
    assert np.isfinite(place(p, "round-robin").mean_latency)


def test_batching_in_the_problem_serves_bursts_better():
    from dataclasses import replace

    p = _problem(models=2, devices=2, rate=8.0, cv=4.0, scale=3.0)
    single = place(p, "selective-replication").attainment
    batched = place(replace(p, max_batch=4, batch_growth=0.25), "selective-replication")
    assert batched.attainment > single
