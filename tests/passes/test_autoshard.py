"""Auto-sharding: the ILP's plans have the known-best structure on small cases."""

import pytest

from graphpar.capture import capture_inference
from graphpar.cost.cluster import mesh_for
from graphpar.errors import MemoryLimitError, ShardingError
from graphpar.ir.parser import parse
from graphpar.ir.printer import print_graph
from graphpar.ir.verify import verify
from graphpar.models import example_batch, get_model
from graphpar.passes import PassContext, PassManager, parse_pipeline
from graphpar.passes.autoshard.auto_shard import ShardingPlans
from graphpar.passes.autoshard.factors import factor_spec
from graphpar.passes.autoshard.strategies import node_strategies


def gpt_graph(batch: int, layers: int = 2):
    ex = get_model("gpt", "125M", device="meta", n_layers=layers)
    module = ex.module.to_empty(device="cpu")  # shapes matter here, not values
    inputs, _ = example_batch("gpt", ex.config, batch)
    return capture_inference(module, inputs).graph


def shard(graph, options):
    ctx = PassContext()
    PassManager(parse_pipeline(f"cleanup,auto-shard{{{options}}}")).run(graph, ctx)
    return next(iter(ctx.result(ShardingPlans).values()))


def test_large_batch_small_model_is_data_parallel():
    graph = gpt_graph(batch=8)
    plan = shard(graph, "mesh=4,time_limit=20")
    assert plan.stats["status"] == "OPTIMAL"
    matmuls = [n for n in graph.nodes if n.op in ("linear", "attention")]
    assert matmuls and all(str(n.output.layout) == "{S(0)}" for n in matmuls)
    verify(graph)
    assert parse(print_graph(graph)) == graph  # layouts print and parse back


def test_fused_qkv_splits_by_heads_without_communication():
    graph = gpt_graph(batch=1, layers=1)
    shard(graph, "mesh=4,time_limit=20")
    qkv = next(n for n in graph.nodes if n.op == "linear")
    attention = graph.find("attention")[0]
    assert str(qkv.output.layout) == "{S(2)}"  # column-parallel: output features split
    assert str(attention.output.layout) == "{S(1)}"  # by heads
    between = graph.nodes[graph.nodes.index(qkv):graph.nodes.index(attention)]
    assert not [n for n in between if n.op == "reshard"]


def test_memory_limit_that_no_plan_meets_says_how_much_is_needed():
    graph = gpt_graph(batch=1, layers=1)
    with pytest.raises(MemoryLimitError, match=r"no plan fits 1.0 MB per device on mesh .*"
                                                r"needs about .* per device; the largest "
                                                r"tensors are"):
        shard(graph, "mesh=4,memory_limit=1MB,time_limit=20")


def test_plans_fit_the_clusters_device_memory_unless_told_otherwise(tmp_path):
    """By default a plan must fit the cluster's memory per device: on devices of 200 MB the
    125M-wide layer's weights are sharded further than without a limit."""
    import json

    from graphpar.cost.cluster import get_cluster

    spec = get_cluster("dgx-a100").to_dict()
    spec["device_memory"] = 200_000_000  # the leanest plan needs 87 MB, the unlimited 341 MB
    small = tmp_path / "small.json"
    small.write_text(json.dumps(spec))
    free = shard(gpt_graph(batch=1, layers=1), f"mesh=4,cluster={small},memory_limit=none")
    fitted = shard(gpt_graph(batch=1, layers=1), f"mesh=4,cluster={small}")
    assert free.memory_bytes > 200_000_000 >= fitted.memory_bytes
    spec["device_memory"] = 1_000_000
    small.write_text(json.dumps(spec))
    with pytest.raises(MemoryLimitError, match=r"no plan fits 1.0 MB per device .*--cluster "
                                                r"dgx-a100-80gb"):
        shard(gpt_graph(batch=1, layers=1), f"mesh=4,cluster={small}")


def test_time_limit_bounds_building_the_problem_too():
    """A limit that building the problem alone exceeds is an error naming the option, raised
    before the solver starts, not a solver run after the limit has passed."""
    graph = gpt_graph(batch=8, layers=1)
    with pytest.raises(ShardingError, match=r"time limit of 0.001 s while (enumerating|building)"
                                            r".*before the ILP solver started; raise "
                                            r"--time-limit"):
        shard(graph, "mesh=2x2x2,time_limit=0.001")


def test_linear_strategies_cover_megatron_and_data_parallel():
    graph = gpt_graph(batch=4, layers=1)
    linear = next(n for n in graph.nodes if n.op == "linear")
    spec = factor_spec(linear)
    assert spec.reductions == [{3: "sum"}]  # the contraction factor gives a partial sum
    layouts = {tuple(str(x) for x in s.inputs[:2]) + (str(s.outputs[0]),)
               for s in node_strategies(linear, mesh_for("4"), 1e12)}
    assert ("{S(0)}", "{R}", "{S(0)}") in layouts  # data parallel
    assert ("{R}", "{S(0)}", "{S(2)}") in layouts  # column parallel
    assert ("{S(2)}", "{S(1)}", "{P}") in layouts  # row parallel: partial sums
