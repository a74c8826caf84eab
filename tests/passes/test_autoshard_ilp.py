"""The reduced auto-sharding ILP: exact simplification, shared layer variables, hand plans, and
the plans it finds for training steps (Megatron-LM's at batch 1, data parallel at a large
batch, sharded state under a memory limit)."""

from collections import Counter, defaultdict

import pytest

from graphpar.capture import Adam, capture_training
from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.compute import Roofline
from graphpar.errors import MemoryLimitError
from graphpar.ir.graph import OutputRole, Role
from graphpar.ir.layout import Layout
from graphpar.ir.parser import parse
from graphpar.ir.structure import node_signature
from graphpar.ir.verify import verify
from graphpar.models import example_batch, get_model
from graphpar.passes import PassContext, PassManager, parse_pipeline
from graphpar.passes.autoshard.apply import shard_graph
from graphpar.passes.autoshard.hand_plans import (
    HAND_PLANS,
    batch_factors,
    hand_plan,
    hand_plans,
    megatron_dim,
    weights_stored_in_out,
)
from graphpar.passes.autoshard.identical_layers import layer_key, repeated_layers
from graphpar.passes.autoshard.ilp import Problem, Reduced

CLUSTER = get_cluster("dgx-a100")
ROOF = Roofline.of(CLUSTER, "fp32")  # the roofline auto-shard prices compute by


def training_graph(batch: int, **config):
    """A GPT training step with Adam, captured with uninitialized weights, after cleanup."""
    ex = get_model("gpt", "125M", device="meta", train=True, **config)
    module = ex.module.to_empty(device="cpu")  # shapes matter here, not values
    inputs, targets = example_batch("gpt", ex.config, batch)
    graph = capture_training(module, inputs, ex.loss_fn, targets, Adam()).graph
    PassManager(parse_pipeline("cleanup")).run(graph, PassContext())
    return graph


@pytest.fixture(scope="module")
def gpt125_batch1():
    """One GPT-125M-shaped block (full hidden size, heads and sequence), batch 1."""
    return training_graph(1, n_layers=1, vocab_size=2048)


@pytest.fixture(scope="module")
def small_gpt():
    """Two small blocks at a large batch (8192 tokens, 4x the hidden size of 512): data
    parallelism should win."""
    return training_graph(64, n_layers=2, d_model=512, n_heads=8, vocab_size=512, seq_len=128)


def reduced(graph, mesh: str, **kw) -> Reduced:
    return Reduced(Problem(graph, mesh_for(mesh, CLUSTER), ROOF), **kw)


@pytest.mark.parametrize("graph", ["small_gpt", "gpt125_batch1"])
def test_simplification_keeps_the_optimum_with_fewer_variables(graph, request):
    graph = request.getfixturevalue(graph)
    for tie in (False, True):
        exact = reduced(graph, "4", simplify=False, tie_layers=tie).solve()
        simple = reduced(graph, "4", tie_layers=tie).solve()
        assert exact.stats["status"] == simple.stats["status"] == "OPTIMAL"
        assert simple.step_seconds == pytest.approx(exact.step_seconds, rel=1e-9)
        assert simple.stats["followers"] > 0
        assert simple.stats["variables"] < exact.stats["variables"] / 2
    # The objective the solver minimized is the plan's cost on the full graph.
    assert simple.stats["objective_seconds"] == pytest.approx(simple.step_seconds, rel=1e-9)


@pytest.fixture(scope="module")
def tiny_gpts():
    """The same tiny GPT with 2 and with 4 layers."""
    return {n: training_graph(2, n_layers=n, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
            for n in (2, 4)}


def test_identical_layers_share_one_set_of_variables(tiny_gpts):
    graphs = tiny_gpts
    plans = {n: reduced(g, "4").solve() for n, g in graphs.items()}
    # Two more layers add no variable: they reuse the shared ones.
    assert plans[2].stats["variables"] == plans[4].stats["variables"]
    assert plans[4].stats["tied_layers"] > plans[2].stats["tied_layers"]
    groups = defaultdict(set)
    counters = Counter()
    for node in graphs[4].nodes:
        sig = node_signature(node)
        counters[(node.module, sig)] += 1
        key = layer_key(node, counters[(node.module, sig)]) if node.module else None
        if key is not None and ".mlp" in key:
            groups[(key, sig)].add(plans[4].node_strategy[node])
    assert groups and all(len(strategies) == 1 for strategies in groups.values())
    weights = {v.name: plans[4].input_layout[v] for v in graphs[4].inputs}
    assert len({weights[f"blocks.{i}.mlp.up.weight"] for i in range(4)}) == 1


def test_problems_on_one_mesh_share_their_resharding_tables(tiny_gpts):
    # The 2- and 4-layer GPTs reshard the same activations between the same layouts: with
    # shared tables the second problem prices no new (shape, layouts) table, and both reduce
    # to the same edge costs and plans as problems built alone.
    mesh = mesh_for("2x2", CLUSTER)
    tables: dict = {}
    shared = {n: Reduced(Problem(g, mesh, ROOF, tables=tables)) for n, g in tiny_gpts.items()}
    priced = len(tables[mesh])
    assert priced > 0
    Reduced(Problem(tiny_gpts[4], mesh, ROOF, tables=tables))
    assert len(tables[mesh]) == priced
    for n, graph in tiny_gpts.items():
        alone = Reduced(Problem(graph, mesh, ROOF))
        assert alone.edges.keys() == shared[n].edges.keys()
        assert all((alone.edges[e] == shared[n].edges[e]).all() for e in alone.edges)
        assert all((a == b).all() for a, b in zip(alone.unary, shared[n].unary))
        assert alone.solve().node_strategy == shared[n].solve().node_strategy


def test_hand_plans_are_valid_and_never_better_than_the_ilp(small_gpt):
    red = reduced(small_gpt, "2x4")
    ilp = red.solve()
    plans = hand_plans(red)
    assert set(plans) == set(HAND_PLANS)
    assert not any(isinstance(plan, str) for plan in plans.values()), plans
    for name, plan in plans.items():
        if isinstance(plan, str):
            continue
        assert plan.name == name and plan.stats["status"] == "OPTIMAL"
        assert ilp.step_seconds <= plan.step_seconds * (1 + 1e-9), name
        graph = small_gpt.copy()
        by_name = {v.name: v for v in graph.inputs}
        nodes = dict(zip(small_gpt.nodes, graph.nodes))
        moved = type(plan)(plan.mesh, {nodes[n]: s for n, s in plan.node_strategy.items()},
                           {by_name[v.name]: lay for v, lay in plan.input_layout.items()})
        shard_graph(graph, plan.mesh, moved)
        verify(graph)
    replicated = Layout.parse("{R,R}")
    data, tp = plans["data"], plans["data+megatron"]
    batch = batch_factors(red.problem)
    for v in small_gpt.inputs_with_role(Role.PARAM):
        assert data.input_layout[v] == replicated
    for node in small_gpt.find("matmul"):
        assert all(f in batch[node] for f in data.node_strategy[node].axis_factors)
    qkv = next(v for v in small_gpt.inputs if v.name == "blocks.0.attn.qkv.weight")
    proj = next(v for v in small_gpt.inputs if v.name == "blocks.0.attn.proj.weight")
    assert str(tp.input_layout[qkv]) == "{R,S(0)}"  # column-parallel on the tensor axis
    assert str(tp.input_layout[proj]) == "{R,S(1)}"  # row-parallel
    zero = plans["zero"]
    state = next(v for v in small_gpt.inputs if v.name == "blocks.0.mlp.up.weight.exp_avg")
    assert zero.input_layout[state].is_sharded and zero.memory_bytes < data.memory_bytes


def test_megatron_dims_follow_how_a_weight_is_stored():
    """nn.Linear stores [out, in] and is read by `linear`; GPT-2's Conv1D stores [in, out] and
    is read by `matmul(x, w)`: column-parallel splits the output features either way."""
    graph = parse("""graph @g(%h.0.attn.c_attn.weight: f32[8,24] param,
    %h.0.attn.o_proj.weight: f32[8,24] param, %x: f32[4,8] input) {
  %0 = matmul(%x, %h.0.attn.c_attn.weight) : f32[4,24]
  %1 = linear(%0, %h.0.attn.o_proj.weight, none) : f32[4,8]
  return %1 output
}""")
    assert weights_stored_in_out(graph) == {"h.0.attn.c_attn.weight"}
    assert megatron_dim("h.0.attn.c_attn.weight", 2) == 0  # [out, in]
    assert megatron_dim("h.0.attn.c_attn.weight", 2, in_out=True) == 1  # [in, out]
    assert megatron_dim("h.0.attn.c_attn.bias", 1, in_out=True) == 0
    assert megatron_dim("h.0.mlp.c_proj.weight", 2) == 1
    assert megatron_dim("h.0.mlp.c_proj.weight.exp_avg", 2, in_out=True) == 0
    assert megatron_dim("h.0.mlp.dense_h_to_4h.weight", 2) == 0  # BLOOM, Falcon, GPT-NeoX
    assert megatron_dim("h.0.mlp.dense_4h_to_h.weight", 2) == 1
    assert megatron_dim("h.0.ln_1.weight", 1) is None


def _forward(graph) -> list:
    loss = next(o.value.producer for o in graph.outputs if o.role.value == "loss")
    return graph.nodes[:graph.nodes.index(loss)]


def test_training_at_batch_one_finds_megatron(gpt125_batch1):
    graph = gpt125_batch1.copy()
    ctx = PassContext()
    PassManager(parse_pipeline("auto-shard{mesh=4}")).run(graph, ctx)
    params = {v.name: str(v.layout) for v in graph.inputs}
    assert params["blocks.0.attn.qkv.weight"] == "{S(0)}"  # column-parallel
    assert params["blocks.0.mlp.up.weight"] == "{S(0)}"
    assert params["blocks.0.attn.proj.weight"] == "{S(1)}"  # row-parallel
    assert params["blocks.0.mlp.down.weight"] == "{S(1)}"
    forward = _forward(graph)
    matmul = {n.module.rsplit(".", 1)[-1]: n for n in forward if n.op == "matmul"}
    assert str(matmul["qkv"].output.layout) == "{S(1)}"  # output features split
    assert str(matmul["up"].output.layout) == "{S(1)}"
    attention = next(n for n in forward if n.op == "attention_with_lse")
    assert str(attention.outputs[0].layout) == "{S(1)}"  # by heads
    assert str(matmul["proj"].output.layout) == "{P}"  # partial sums
    assert str(matmul["down"].output.layout) == "{P}"
    # Megatron's two reductions per block (all-reduce, or reduce-scatter + all-gather).
    reductions = [n for n in forward if n.op == "reshard" and n.inputs[0].layout.is_partial
                  and n.module.startswith("blocks.0")]
    assert len(reductions) == 2
    assert {r.module for r in reductions} == {"blocks.0.attn.proj", "blocks.0.mlp.down"}


def test_large_batch_small_model_is_data_parallel(small_gpt):
    plan = reduced(small_gpt, "4").solve()
    batch = batch_factors(Problem(small_gpt, mesh_for("4", CLUSTER), ROOF))
    heavy = [n for n in small_gpt.nodes if n.op in ("matmul", "attention_with_lse",
                                                      "attention_backward")]
    for node in heavy:
        assert plan.node_strategy[node].axis_factors[0] in batch[node], node
    for v in small_gpt.inputs_with_role(Role.PARAM):
        if v.type.rank == 2 and v.name.startswith("blocks."):  # weight matrices
            assert plan.layout_of(v).is_replicated, v.name


def test_memory_limit_shards_state_and_parameters(small_gpt):
    red = reduced(small_gpt, "4")
    data, zero = hand_plan(red, "data"), hand_plan(red, "zero")
    free = red.solve()
    limit = 0.72 * data.memory_bytes  # below data parallel's and ZeRO's (states only)
    for name in ("data", "zero"):
        with pytest.raises(MemoryLimitError):
            hand_plan(red, name, memory_limit=limit)
    plan = red.solve(memory_limit=limit)
    assert plan.memory_bytes <= limit < zero.memory_bytes
    weights = [v for v in small_gpt.inputs_with_role(Role.PARAM) if v.type.rank == 2]
    assert any(plan.layout_of(v).is_sharded for v in weights)
    assert plan.step_seconds >= free.step_seconds * (1 - 1e-9)
    with pytest.raises(MemoryLimitError, match="no plan fits"):
        red.solve(memory_limit=1e6)


def test_solvers_agree_and_plans_are_deterministic(tiny_gpts):
    graph = tiny_gpts[4]
    red = reduced(graph, "4")
    first = red.solve()
    again = reduced(graph, "4").solve()
    assert first.node_strategy == again.node_strategy
    assert first.input_layout == again.input_layout
    # without a memory limit no MIP is built (elimination solves it); a memory row that never
    # binds makes each solver solve the MIP, and they find the elimination's optimum
    assert first.stats["variables"] == 0
    for solver in ("highs", "cp-sat", "scip", "cbc"):
        other = red.solve(memory_limit=1e15, solver=solver)
        assert other.stats["variables"] > 0
        assert other.step_seconds == pytest.approx(first.step_seconds, rel=1e-6), solver


def test_repeated_layers_are_the_identical_blocks(tiny_gpts):
    graph = tiny_gpts[4]
    blocks, updates = repeated_layers(graph)
    # Layer 0's backward also makes the embeddings' gradient: it is not like the others.
    assert [layer.name for layer in blocks.layers] == [f"blocks.{i}" for i in (1, 2, 3)]
    assert [layer.name for layer in updates.layers] == [f"optimizer.blocks.{i}"
                                                        for i in range(4)]
    first = blocks.representative
    assert [v.name for v in first.inputs][:2] == ["blocks.1.ln1.weight", "blocks.1.ln1.bias"]
    for k in range(len(first.nodes)):
        assert len({node_signature(n) for n in blocks.same_place(k)}) == 1
    for i, layer in zip((1, 2, 3), blocks.layers):  # every node of the layer, in graph order
        assert list(layer.nodes) == [n for n in graph.nodes
                                     if (n.module or "").startswith(f"blocks.{i}.")]


@pytest.mark.parametrize("mesh", ["4", pytest.param("2x2", marks=pytest.mark.slow)])
def test_one_solve_for_identical_layers_gives_the_full_ilp_plan(tiny_gpts, mesh):
    graph = tiny_gpts[4]
    tied = reduced(graph, mesh, tie_layers=True).solve()
    full = reduced(graph, mesh, tie_layers=False).solve()
    assert tied.stats["free_classes"] < full.stats["free_classes"]
    assert tied.step_seconds == pytest.approx(full.step_seconds, rel=1e-9)
    assert tied.memory_bytes == full.memory_bytes
    assert {n: s.outputs for n, s in tied.node_strategy.items()} == \
        {n: s.outputs for n, s in full.node_strategy.items()}
    assert tied.input_layout == full.input_layout


@pytest.mark.parametrize("solver", ["highs", "cp-sat", "scip", "cbc"])
def test_a_graph_with_nothing_to_choose_is_solved_under_a_memory_limit(solver):
    # A pipeline stage's forward that only counts batch-norm steps: a scalar i64 add, one
    # layout to pick from, so the ILP has no variables; HiGHS, given a memory row and no
    # variables, answered neither optimal nor infeasible, and the stage failed to shard.
    from graphpar.ir.parser import parse_program

    graph = next(iter(parse_program(
        "graph @stage1_forward(\n"
        "    %stem.1.num_batches_tracked: i64[] buffer,\n"
        ") {\n"
        "  %0 = add(%stem.1.num_batches_tracked, 1) : i64[]\n"
        "  return %0 update(%stem.1.num_batches_tracked)\n"
        "}\n")))
    red = Reduced(Problem(graph, mesh_for((2, 1), CLUSTER), ROOF))
    plan = red.solve(memory_limit=4 * 2**30, solver=solver, time_limit=10)
    assert plan.memory_bytes == 8  # the i64 buffer, whole on each device
    assert all(layout.is_replicated for layout in plan.input_layout.values())


def test_gradients_all_reduced_in_buckets_are_priced_so():
    """A `graphpar train` rank all-reduces gradients in ~1 MiB buckets (runtime/overlap.py):
    with `bucket_bytes` the ILP prices the all-reduces into the optimizer update with their
    share of one bucket's latency, and every other resharding as before. On the measured CPU
    cluster (about 1 ms per all-reduce step) that takes data parallelism from four times the
    replicated step's estimate to about the same."""
    graph = training_graph(8, n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
    mesh = mesh_for("2", "cpu-gloo")
    roof = Roofline.of(mesh.cluster, "fp32")
    alone, bucketed = (Problem(graph, mesh, roof, bucket_bytes=b) for b in (None, 1 << 20))
    assert not alone.bucketed_edges
    update_only = graph.nodes_only_reaching(OutputRole.UPDATE)
    loss_only = graph.nodes_only_reaching(OutputRole.LOSS)
    params = graph.inputs_with_role(Role.PARAM)
    # a value's all-reduce waits when all its readers wait: only update work, or only the
    # loss's last reduction
    for e in bucketed.bucketed_edges:
        users = set(bucketed.edges[e][0].users)
        assert users <= update_only or users <= loss_only, bucketed.edges[e]
    # cross-entropy's count of tokens: read by the loss and by the backward, so not deferred
    count = next(n for n in graph.nodes if n.op == "nll_loss").outputs[1]
    assert {u.op for u in count.users} >= {"div", "nll_loss_backward"}
    assert not any(bucketed.edges[e][0] is count for e in bucketed.bucketed_edges)
    # every parameter has its update among the update-only nodes
    updates = {n for n in update_only if any(v in params for v in n.input_values)}
    assert len(updates) >= len(params)

    data = [hand_plan(Reduced(p), "data") for p in (alone, bucketed)]
    picks = alone.picks(data[0])  # one plan, priced both ways
    before = {e: s for e, _, s in alone.edge_seconds(picks)}
    after = {e: s for e, _, s in bucketed.edge_seconds(picks)}
    assert before.keys() == after.keys()
    cheaper = [e for e in after if after[e] < before[e] * (1 - 1e-9)]
    assert set(cheaper) <= bucketed.bucketed_edges and len(cheaper) >= len(params) - 2
    assert all(after[e] == before[e] for e in after if e not in bucketed.bucketed_edges)
    replicated = Reduced(bucketed).solve()
    assert data[0].step_seconds > 3 * replicated.step_seconds
    assert data[1].step_seconds < 1.2 * replicated.step_seconds
