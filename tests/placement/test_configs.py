"""Parallel configurations: the serving stage DP against brute force, configs' arithmetic,
and a bundled model's profile against its parameter count."""

import itertools

import numpy as np
import pytest

from graphpar.models import get_config, get_model, param_count
from graphpar.placement.configs import (
    LayerProfile,
    configs_for,
    profile_example,
    profile_module,
    stage_bounds,
)


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


def _mlp():
    # two 4096-wide linears on 8192 rows: big enough that sharding pays (weightless, on meta)
    import torch

    return get_model("mlp", "tiny", batch_size=8192, device="meta", dtype=torch.float16,
                     in_dim=4096, hidden_dim=4096, out_dim=4096, n_layers=2)


def test_config_latencies_are_the_ilps_objective_per_stage():
    from graphpar.capture import capture_inference
    from graphpar.cost.cluster import get_cluster, mesh_for
    from graphpar.cost.compute import Roofline
    from graphpar.passes.autoshard.ilp import Problem, Reduced
    from graphpar.passes.pipeline.partition import stage_subgraph

    model = _mlp()
    prof = profile_module("mlp", model.module, model.inputs)
    assert prof.pricing == "ilp"
    assert prof.stages.layers == [(0, 0), (1, 1), (2, 2)]  # linear, gelu, linear
    configs = {c.label: c for c in configs_for(prof, 6)}
    assert set(configs) == {"3x2"}  # one layer per stage, 2-way intra-op each

    # the last stage, solved here on its own: the least ILP objective over the logical
    # meshes of a 2-device sub-mesh, exactly the config's latency
    graph = capture_inference(model.module, tuple(model.inputs)).graph
    last = stage_subgraph(graph, list(graph.nodes)[2:3], "last")
    roof = Roofline.of(get_cluster("dgx-a100"), "fp16")
    plans = [Reduced(Problem(last, mesh_for(shape), roof)).solve(None, 30.0)
             for shape in ((2, 1), (1, 2))]
    best = min(plans, key=lambda p: p.step_seconds)
    assert configs["3x2"].stage_latency[-1] == best.step_seconds
    # priced with its collectives: half the FLOPs and bytes of one device (the roofline's
    # per-call overhead does not split), plus an all-reduce
    assert prof.seconds[2] / 2 < best.compute_seconds < prof.seconds[2]
    assert best.comm_seconds > 0
    # stages before the last add the send of their boundary to the next stage
    assert all(t > 0 for t in configs["3x2"].stage_latency)


def test_a_2_way_intra_op_config_halves_the_weights_and_pays_collectives():
    model = _mlp()
    prof = profile_module("mlp", model.module, model.inputs)
    one, two = (configs_for(prof, n)[-1] for n in (1, 2))
    assert (one.label, two.label) == ("1x1", "1x2")
    assert one.stage_latency[0] == pytest.approx(prof.latency)
    assert two.weight_bytes_per_device == pytest.approx(one.weight_bytes_per_device / 2,
                                                        rel=1e-3)
    # faster than one device, slower than half of it: the collectives are in the price
    assert prof.latency / 2 < two.stage_latency[0] < prof.latency


def test_without_the_ilp_the_profile_says_why_and_configs_are_estimated(monkeypatch):
    from graphpar.passes.pipeline import slice_stages

    def unavailable(*args, **kwargs):
        raise ImportError("no module named 'ortools'")

    monkeypatch.setattr(slice_stages, "ServingStages", unavailable)
    model = get_model("gpt", "tiny", batch_size=1, device="meta")
    prof = profile_module("gpt", model.module, model.inputs)
    assert prof.pricing == ("estimate: the auto-shard ILP is unavailable (no module named "
                            "'ortools')")
    assert prof.stages is None
    assert [c.label for c in configs_for(prof, 2)] == ["2x1", "1x2"]
