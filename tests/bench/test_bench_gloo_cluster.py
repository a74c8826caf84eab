"""The gloo calibration: its alpha-beta fit recovers known numbers, and the cluster file it
wrote for this machine is a valid cluster (timings themselves are not asserted)."""

import importlib.util
from pathlib import Path

import pytest

from graphpar.cost.cluster import load_cluster

BENCH = Path(__file__).parents[2] / "tools" / "bench"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gloo", BENCH / "gloo_cluster.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_fit_recovers_latency_and_bandwidth():
    a, b = 150e-6, 2e9
    rows = [{"bytes": m, "all_gather_s": a + m / (2 * b), "all_reduce_s": 2 * a + m / b}
            for m in _bench().SIZES]
    latency, bandwidth = _bench().fit(rows)
    assert latency == pytest.approx(a, rel=1e-6) and bandwidth == pytest.approx(b, rel=1e-6)


def test_the_measured_cluster_file_loads():
    cluster = load_cluster(BENCH / "gloo_cluster.json")
    assert cluster.name == "cpu-measured" and cluster.device == "cpu-process"
    assert 0 < cluster.intra_node_latency < 0.1 and cluster.intra_node_bandwidth > 1e6
    assert "Measured by tools/bench/gloo_cluster.py" in cluster.source


def test_a_cluster_file_plans_and_lowers():
    """auto-shard records the cluster file, and lower-spmd reads it back to lower the plan."""
    import torch

    import graphpar
    from graphpar.cost.cluster import get_cluster
    from graphpar.models import get_model

    ex = get_model("mlp", "tiny")
    compiled = graphpar.compile(ex.module, ex.inputs, mesh="2",
                                cluster=str(BENCH / "gloo_cluster.json"), time_limit=10)
    assert compiled.graph.mesh.cluster == get_cluster(str(BENCH / "gloo_cluster.json"))
    (out,) = compiled.run(*ex.inputs)
    torch.testing.assert_close(out, ex.module(*ex.inputs), rtol=1e-5, atol=1e-5)
