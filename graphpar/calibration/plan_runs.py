"""Running named plans of a bundled model on gloo ranks and comparing each node with its price:
what `tools/bench/plan_quality.py` ranks plans by and what `graphpar calibrate` fits its
in-step factors to (`graphpar.calibration.in_step`).

    case = capture_case("gpt", "train", batch=8, config=dict(d_model=256, n_layers=2))
    plan, compiled = solve_plan(case, mesh_for("2", cluster), "megatron")
    times = compiled.time_steps(5, 2, args=case.args, profile=True)[-1]
    rows = node_rows(compiled.spmd, compiled.mesh, times)   # per node: price and measured

A plan is the ILP's ("ilp", as the auto-shard pass solves it: compute priced by the roofline
of the mesh's cluster) or a hand plan (`passes/autoshard/hand_plans.py`), written into a copy
of the case's graph and lowered to the device program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphpar.capture import Adam, Captured, capture_inference, capture_training
from graphpar.compiler.api import Compiled, lower
from graphpar.cost.communication import node_comm_cost
from graphpar.cost.compute import Roofline, node_seconds, op_class, result_bytes
from graphpar.ir.spmd_ops import LOCAL_OPS
from graphpar.passes import PassContext, PassManager, parse_pipeline
from graphpar.passes.autoshard.apply import shard_graph
from graphpar.passes.autoshard.auto_shard import ShardingPlans
from graphpar.passes.autoshard.hand_plans import hand_plan
from graphpar.passes.autoshard.ilp import Problem, Reduced

__all__ = ["DECODERS", "NodeRow", "PlanCase", "capture_case", "decode_args", "node_rows",
           "program_seconds", "solve_plan"]

DECODERS = ("gpt", "llama")  # models with a decode step; the others run inference


@dataclass
class PlanCase:
    """One model in one mode: its captured step (cleaned up), with the tensors to run it on."""

    model: str
    mode: str
    captured: Captured
    args: tuple[torch.Tensor, ...]


def capture_case(model: str, mode: str, *, batch: int, config: dict | None = None,
                 preset: str = "tiny", past: int | None = None) -> PlanCase:
    """Bundled `model` at `preset` (fields overridden by `config`) captured in `mode` with real
    weights: "train" (forward, backward, Adam), "decode" (for decoders: one new token per
    sequence over a KV cache of `past` tokens, default seq_len - 1) or anything else
    (inference)."""
    from graphpar.capture.decoder import capture_decode
    from graphpar.models import get_model

    ex = get_model(model, preset, batch_size=batch, train=mode == "train", **(config or {}))
    name = f"{model}_{preset}".replace(".", "_")
    if mode == "train":
        captured = capture_training(ex.module, ex.inputs, ex.loss_fn, ex.targets, Adam(),
                                    name=f"{name}_train")
        args = (*ex.inputs, *ex.targets)
    elif mode == "decode" and model in DECODERS:
        past = min(ex.config.seq_len - 1 if past is None else past, ex.config.seq_len - 1)
        captured = capture_decode(ex.module, batch, past)
        args = decode_args(captured, ex.config.vocab_size, past)
    else:
        captured = capture_inference(ex.module, ex.inputs, name=f"{name}_infer")
        args = tuple(ex.inputs)
    PassManager(parse_pipeline("cleanup")).run(captured.graph, PassContext())
    return PlanCase(model if preset == "tiny" else f"{model}:{preset}", mode, captured, args)


def decode_args(captured: Captured, vocab: int, past: int) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs: token ids, positions after `past` tokens, a full attention
    mask and random K/V caches, in the graph's input order."""
    g = torch.Generator().manual_seed(0)
    args = []
    for v in captured.graph.inputs:
        if v.name not in captured.user_inputs:
            continue
        shape = v.type.shape
        if v.name == "input_ids":
            args.append(torch.randint(0, vocab, shape, generator=g))
        elif v.name == "positions":
            args.append(torch.full(shape, past, dtype=torch.long))
        elif v.name == "attn_mask":
            args.append(torch.ones(shape, dtype=torch.bool))
        else:
            args.append(torch.randn(shape, generator=g, dtype=v.type.dtype))
    return tuple(args)


def solve_plan(case: PlanCase, mesh, name: str, memory_limit: float | None = None,
               time_limit: float = 60.0):
    """(plan, compiled) for plan `name` on `mesh`: solved, written into a copy of the case's
    graph and lowered. `memory_limit`: bytes per device (default: the cluster's). Raises
    NotApplicable (a hand plan the model has no place for) or MemoryLimitError."""
    graph = case.captured.graph.copy()
    if memory_limit is None:
        memory_limit = float(mesh.cluster.device_memory)
    reduced = Reduced(Problem(graph, mesh, Roofline.of(mesh.cluster, "fp32")))
    if name == "ilp":
        plan = reduced.solve(memory_limit, time_limit=time_limit)
    else:
        plan = hand_plan(reduced, name, memory_limit, time_limit=time_limit)
    shard_graph(graph, mesh, plan)
    ctx = PassContext()
    ctx.result(ShardingPlans)[graph.name] = plan
    return plan, lower(Captured(graph, case.captured.state), ctx)


@dataclass(frozen=True)
class NodeRow:
    """One node of a device program: how the cost model prices it and what it took."""

    op: str
    kind: str  # its compute class ("gemm", ..., "free"), or its collective's kind
    collective: bool
    group: int  # devices in the collective's group (1 for compute)
    nbytes: int  # the collective's buffer (0 for compute)
    predicted: float  # seconds on one device (estimated)
    measured: float  # seconds (measured: the ranks' mean of the node's mean per step)
    result_bytes: int = 0  # a compute node's results on one device (fresh memory in a step)


def node_rows(compiled: Compiled, times=None, roofline: Roofline | None = None
              ) -> list[NodeRow]:
    """Every node of `compiled`'s device program with its price (compute: the roofline on its
    local shapes, `roofline` or the mesh cluster's; collectives: alpha-beta on their buffer)
    and its measured seconds, the mean over ranks of `times.node_seconds` (a profiled run;
    0 without `times`). Their prices add up to the program's estimate, which can be below the
    plan's objective: the ILP prices a value resharded for several consumers once per
    consumer, the lowering emits the collective once."""
    mesh = compiled.mesh
    roof = roofline or Roofline.of(mesh.cluster, "fp32")
    ranks = times.node_seconds if times is not None else [{}]
    rows = []
    for index, node in enumerate(compiled.spmd.nodes):
        measured = sum(r.get(index, 0.0) for r in ranks) / len(ranks)
        comm = node_comm_cost(node, mesh)
        if comm is not None:
            rows.append(NodeRow(node.op, comm.kind.value, True, comm.group_size,
                                int(comm.nbytes), comm.seconds, measured))
        elif node.op in LOCAL_OPS:  # a reshard's free local step, as the plan priced it
            rows.append(NodeRow(node.op, "free", False, 1, 0, 0.0, measured))
        else:
            operands = [getattr(v, "type", v) for v in node.inputs]
            rows.append(NodeRow(node.op, op_class(node.op, operands), False, 1, 0,
                                node_seconds(node, roof), measured,
                                result_bytes([o.type for o in node.outputs])))
    return rows


def program_seconds(compiled: Compiled) -> float:
    """The estimated seconds of one step of `compiled`'s device program: its nodes priced."""
    return sum(r.predicted for r in node_rows(compiled))
