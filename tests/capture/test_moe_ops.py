"""The ops mixture-of-experts layers capture to (grouped_mm, histc, index_add): each equal to
eager PyTorch, and each of their sharding strategies, run on 2 ranks, equal to the unsharded
result."""

import pytest
import torch

from graphpar.capture import Captured, capture_inference, capture_training
from graphpar.compiler.api import lower
from graphpar.cost.cluster import mesh_for
from graphpar.errors import UnsupportedOpError
from graphpar.ir.graph import OutputRole
from graphpar.ir.registry import get_op
from graphpar.passes import PassContext
from graphpar.passes.autoshard.apply import shard_graph
from graphpar.passes.autoshard.auto_shard import ShardingPlans
from graphpar.passes.autoshard.ilp import Plan
from graphpar.passes.autoshard.strategies import node_strategies, replicated


def grouped_by_loop(a, b, ends):
    """What a grouped matmul means, one expert at a time (groups end at `ends`)."""
    out, start = [], 0
    for e, end in enumerate(ends):
        out.append(a[start:end] @ b[e])
        start = end
    rows = torch.cat(out)
    return torch.cat([rows, rows.new_zeros(a.shape[0] - rows.shape[0], b.shape[2])])


def test_grouped_mm_reference_computes_each_experts_rows_and_weight_gradients():
    torch.manual_seed(0)
    a, b = torch.randn(7, 4), torch.randn(3, 4, 5)
    starts, ends = torch.tensor([0, 2, 2]), torch.tensor([2, 2, 6])  # expert 1 gets no rows
    ref = get_op("grouped_mm").reference
    torch.testing.assert_close(ref(a, b, starts, ends), grouped_by_loop(a, b, [2, 2, 6]))
    g = torch.randn(7, 5)
    dw = ref(a.T, g, starts, ends)  # the weight-gradient form: [E, K, N]
    torch.testing.assert_close(dw[0], a[:2].T @ g[:2])
    assert not dw[1].any()
    torch.testing.assert_close(dw[2], a[2:6].T @ g[2:6])


class TorchGroupedMM(torch.nn.Module):
    def forward(self, x, w, offs):
        return torch.nn.functional.grouped_mm(x, w, offs=offs)


def test_aten_grouped_mm_captures_to_grouped_mm():
    """torch's grouped matmul (bfloat16 where torch.export traces it)."""
    torch.manual_seed(0)
    x, w = torch.randn(8, 16).bfloat16(), torch.randn(3, 16, 8).bfloat16()
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)
    captured = capture_inference(TorchGroupedMM(), (x, w, offs))
    assert [n.op for n in captured.graph.nodes if n.op == "grouped_mm"] == ["grouped_mm"]
    (out,) = captured.run(x, w, offs)
    # bfloat16 products of 16 terms: a few units in the last place of 8 mantissa bits
    torch.testing.assert_close(out, TorchGroupedMM()(x, w, offs), atol=0.05, rtol=0.02)


class Routed(torch.nn.Module):
    """A token-routing toy: counts per expert (histc), scatter-added rows (index_add), and a
    clamp with tensor bounds, as MoE routers write them."""

    def forward(self, x, idx, src):
        counts = torch.histc(idx.float(), bins=4, min=0, max=3)
        rows = torch.index_add(x, 0, idx, src, alpha=2.0)
        return rows * counts.sum() + torch.clamp(x, min=x.amax(-1, keepdim=True) - 1.0)


def routed_inputs():
    torch.manual_seed(0)
    return torch.randn(4, 8), torch.tensor([0, 3, 3, 1, 0, 2]), torch.randn(6, 8)


def test_histc_index_add_and_tensor_clamp_match_eager():
    args = routed_inputs()
    captured = capture_inference(Routed(), args)
    assert {"histc", "index_add", "maximum"} <= {n.op for n in captured.graph.nodes}
    (out,) = captured.run(*args)
    torch.testing.assert_close(out, Routed()(*args), atol=1e-5, rtol=1e-5)


class Bincount(torch.nn.Module):
    def forward(self, idx):
        return torch.bincount(idx, minlength=4)


def test_bincount_says_to_count_with_histc():
    with pytest.raises(UnsupportedOpError, match=r"bincount.*torch.histc\(x.float\(\), bins=n"):
        capture_inference(Bincount(), (torch.tensor([0, 3, 3, 1]),))


def every_strategy_of(captured: Captured, op: str, args, expected):
    """Each strategy of each `op` node in turn (everything else replicated), lowered to 2
    ranks and run in lockstep: every one gives the unsharded outputs."""
    mesh = mesh_for("2", "cpu")
    base = captured.graph
    tried = 0
    for index, node in enumerate(base.nodes):
        if node.op != op:
            continue
        for choice in range(len(node_strategies(node, mesh, 1e12))):
            graph = base.copy()
            plan = Plan(mesh, {}, {})
            for v in graph.inputs:
                plan.input_layout[v] = replicated(mesh)
            for i, n in enumerate(graph.nodes):
                strategies = node_strategies(n, mesh, 1e12)
                plan.node_strategy[n] = strategies[choice if i == index else 0]
            shard_graph(graph, mesh, plan)
            ctx = PassContext()
            ctx.result(ShardingPlans)[graph.name] = plan
            outputs = lower(Captured(graph, captured.state), ctx).run(*args)
            for got, want in zip(outputs, expected):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            tried += 1
    return tried


def test_every_index_add_strategy_matches_unsharded():
    args = routed_inputs()
    captured = capture_inference(Routed(), args)
    assert every_strategy_of(captured, "index_add", args, [Routed()(*args)]) >= 3


transformers = pytest.importorskip("transformers")


class Experts(torch.nn.Module):
    """Stacked expert weights applied by transformers' grouped matmul, as its MoE layers do
    on the CPU (whose backward is a second library op)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8, 6))
        self.register_buffer("offs", torch.tensor([2, 2, 6, 8], dtype=torch.int32))

    def forward(self, x):
        import transformers.integrations.moe  # noqa: F401  (registers the op)

        return torch.ops.transformers.grouped_mm_fallback(x, self.w, self.offs).tanh()


def test_every_grouped_mm_strategy_of_forward_and_backward_matches_eager():
    """Experts split (a partial sum in the forward, whole gradients per expert in the
    backward), the expert's n or k dims split: all equal to eager's loss and gradient."""
    torch.manual_seed(0)
    module, x = Experts(), torch.randn(8, 8)
    captured = capture_training(module, (x,), lambda out: out.pow(2).sum())
    assert sum(n.op == "grouped_mm" for n in captured.graph.nodes) == 3  # y, dx, dw
    assert any(n.op == "grouped_mm" and n.inputs[1].type.rank == 2 for n in captured.graph.nodes)
    loss = module(x).pow(2).sum()
    loss.backward()
    expected = [loss.detach() if o.role is OutputRole.LOSS else module.w.grad
                for o in captured.graph.outputs]
    assert every_strategy_of(captured, "grouped_mm", (x,), expected) >= 9
