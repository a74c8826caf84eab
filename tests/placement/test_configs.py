"""Parallel configurations: the serving stage DP against brute force, configs' arithmetic,
and a bundled model's profile against its parameter count."""

import itertools

import numpy as np
import pytest

from graphpar.models import get_config, param_count
from graphpar.placement.configs import LayerProfile, configs_for, profile_example, stage_bounds


def _brute(t, stages):
    best = np.inf
    for cuts in itertools.combinations(range(1, len(t)), stages - 1):
        edges = [0, *cuts, len(t)]
        best = min(best, max(sum(t[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_stage_dp_minimises_the_slowest_stage(seed):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.1, 2.0, size=int(rng.integers(3, 9)))
    for stages in range(1, len(t) + 1):
        bounds = stage_bounds(t, stages)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(t) and len(bounds) == stages
        assert all(a < b for a, b in bounds)
        assert max(t[a:b].sum() for a, b in bounds) == pytest.approx(_brute(list(t), stages))


def test_configs_cover_the_group_and_split_weights():
    prof = LayerProfile("m", (1.0, 1.0, 2.0, 2.0), (4.0, 4.0, 8.0, 8.0), (1e3,) * 4)
    configs = {c.label: c for c in configs_for(prof, 4)}
    assert set(configs) == {"4x1", "2x2", "1x4"}
    assert configs["1x4"].weight_bytes_per_device == pytest.approx(24.0 / 4)
    two = configs["2x2"]
    # every 2-stage split of layers (1, 1, 2, 2) s has a stage of at least 4 s, halved by
    # intra-op degree 2 (plus microseconds of all-reduce and send for 1 kB)
    assert max(two.stage_latency) == pytest.approx(2.0, rel=1e-3)
    assert two.weight_bytes_per_device == pytest.approx(16.0 / 2)
    # intra-op shards compute but pays an all-reduce per layer
    assert sum(configs["1x4"].stage_latency) > 6.0 / 4


def test_a_bundled_models_profile_holds_its_parameters():
    prof = profile_example("gpt:tiny", dtype="fp16")
    assert prof.weights == pytest.approx(2 * param_count("gpt", get_config("gpt", "tiny")),
                                         rel=0.02)
    assert len(prof.seconds) >= 2 and prof.latency > 0
