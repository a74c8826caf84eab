"""Auto-sharding: the ILP's plans have the known-best structure on small cases."""

import pytest

from graphpar.capture import capture_inference
from graphpar.cost.cluster import mesh_for
from graphpar.cost.compute import Roofline
from graphpar.cost.limits import PlanLimits
from graphpar.errors import MemoryLimitError, TimeLimitError
from graphpar.ir.parser import parse
from graphpar.ir.printer import print_graph
from graphpar.ir.verify import verify
from graphpar.models import example_batch, get_model
from graphpar.passes import PassContext, PassManager, parse_pipeline
from graphpar.passes.autoshard.apply import shard_graph
from graphpar.passes.autoshard.auto_shard import ShardingPlans
from graphpar.passes.autoshard.factors import factor_spec
from graphpar.passes.autoshard.ilp import Problem, solve
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


def _layouts(graph, plan, ops=("embedding", "layer_norm", "linear", "attention")):
    return [(n.op, str(plan.node_strategy[n].outputs[0])) for n in graph.nodes if n.op in ops]


def test_fused_qkv_splits_by_heads_and_the_roofline_shards_the_residual_stream():
    """Batch 1, one 125M-wide block on 4 A100s. Priced by FLOPs alone, the plan is Megatron's
    attention: replicated embedding and norm, the fused qkv column-parallel and reshaped into
    heads without communication. Priced by the roofline, the replicated embedding, add and
    norm each read and write the whole [1024, 768] activation on every device, which the
    FLOP count never charged: the plan shards them by sequence (16 us less compute) and
    moves qkv's output into heads with an all-to-all (9 us more communication), as
    DeepSpeed-Ulysses does; docs/autoshard.md has the numbers."""
    graph = gpt_graph(batch=1, layers=1)
    PassManager(parse_pipeline("cleanup")).run(graph, PassContext())
    mesh = mesh_for("4", "dgx-a100")
    roof = Roofline.of(mesh.cluster, "fp32")
    _, by_flops = solve(graph, mesh, mesh.cluster.peak_flops("fp32"), PlanLimits(None, 20))
    assert _layouts(graph, by_flops)[:5] == [
        ("embedding", "{R}"), ("layer_norm", "{R}"),
        ("linear", "{S(2)}"),  # column-parallel qkv: output features split ...
        ("attention", "{S(1)}"),  # ... which are the heads: no reshard in between
        ("linear", "{S(1)}")]  # row-parallel proj, reduce-scattered into the sequence
    _, by_roofline = solve(graph, mesh, roof, PlanLimits(None, 20))
    assert by_roofline.stats["status"] == "OPTIMAL"
    assert _layouts(graph, by_roofline)[:5] == [
        ("embedding", "{S(1)}"), ("layer_norm", "{S(1)}"),  # sequence-parallel
        ("linear", "{S(1)}"),  # qkv by sequence, then all-to-all into heads
        ("attention", "{S(1)}"), ("linear", "{S(1)}")]
    megatron = Problem(graph, mesh, roof).recost(by_flops)
    assert by_roofline.step_seconds < megatron.step_seconds
    assert by_roofline.compute_seconds < megatron.compute_seconds
    assert by_roofline.comm_seconds > megatron.comm_seconds
    shard_graph(graph, mesh, by_roofline)
    qkv = next(n for n in graph.nodes if n.op == "linear")
    attention = graph.find("attention")[0]
    between = graph.nodes[graph.nodes.index(qkv):graph.nodes.index(attention)]
    moves = [n for n in between if n.op == "reshard"]
    assert [(str(m.inputs[0].layout), str(m.output.layout)) for m in moves] == \
        [("{S(1)}", "{S(2)}")]  # one all-to-all: sequence -> features (heads)


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
    with pytest.raises(TimeLimitError, match=r"time limit of 0.001 s while (enumerating|"
                                             r"building).*before the ILP solver started; "
                                             r"raise --time-limit"):
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
