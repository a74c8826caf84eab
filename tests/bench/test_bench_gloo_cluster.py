"""tools/bench/gloo_cluster.py, `graphpar calibrate` writing beside itself: the cluster file it
wrote for this machine is a complete, valid cluster that plans and lowers (timings themselves
are not asserted; the fits are tested in tests/cost/test_fit.py)."""

import warnings
from pathlib import Path

from graphpar.cost.cluster import ClusterFallbackWarning, load_cluster
from graphpar.ir.cluster import COMPUTE_CLASSES

BENCH = Path(__file__).parents[2] / "tools" / "bench"


def test_the_script_passes_its_defaults_to_calibrate(load_bench, monkeypatch):
    import importlib

    seen = []
    cli = importlib.import_module("graphpar.cli.main")  # the module (graphpar.cli.main is
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 0)  # also a function)
    bench = load_bench("gloo_cluster")
    assert bench.main(["--quick"]) == 0
    assert seen == [["calibrate", "--ranks", "2", "--out", str(bench.OUT), "--quick"]]
    assert bench.main(["--ranks", "4", "--out", "x.json"]) == 0
    assert seen[-1] == ["calibrate", "--ranks", "4", "--out", "x.json"]


def test_the_measured_cluster_file_loads_complete():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClusterFallbackWarning)
        cluster = load_cluster(BENCH / "gloo_cluster.json")
    assert cluster.name == "cpu-measured" and cluster.device == "cpu-process"
    assert 0 < cluster.intra_node_latency < 0.1 and cluster.intra_node_bandwidth > 1e6
    assert "Measured by `graphpar calibrate --ranks 2`" in cluster.source
    assert {row[1] for row in cluster.compute} == set(COMPUTE_CLASSES)
    assert cluster.collective_rate("all_reduce") is not None


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
