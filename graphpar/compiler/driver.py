"""The compile driver behind `graphpar compile` and the Python API: capture, then a pipeline."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphpar.capture import Captured, capture_inference, capture_training
from graphpar.capture.fake import has_meta_tensors, real_state
from graphpar.capture.optim import Optimizer
from graphpar.errors import UsageError
from graphpar.ir.graph import Graph, Program, Role
from graphpar.ir.printer import node_flops
from graphpar.passes import PassContext, PassManager, parse_pipeline
from graphpar.passes.autoshard.auto_shard import ShardingPlans

DEFAULT_PIPELINE = "cleanup"


@dataclass
class ModelSpec:
    """What to compile: a module, example inputs and, for training, a loss and its targets."""

    name: str
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[..., torch.Tensor] | None = None
    targets: tuple[torch.Tensor, ...] = ()
    source: str = ""  # where it came from: a file path or "graphpar.models:gpt/tiny"
    # The module with real weights, for one built on the meta device; by default it
    # initializes itself (see graphpar.models.memory.initialize_on_cpu).
    make_real: Callable[[], torch.nn.Module] | None = None

    def real_module(self) -> torch.nn.Module:
        """The module with real weights: made now, once, if it was built on the meta device
        (planning needs only shapes; running needs weights)."""
        from graphpar.models.memory import initialize_on_cpu, materialize, tensor_bytes

        if has_meta_tensors(self.module):
            make = self.make_real or (lambda: initialize_on_cpu(self.module))
            self.module = materialize(f"the weights of {self.name}",
                                      tensor_bytes(self.module), make)
        return self.module


@dataclass
class CompileResult:
    """A captured and transformed program, with what each step took."""

    spec: ModelSpec
    mode: str
    captured: Captured
    program: Program
    capture_seconds: float
    pass_manager: PassManager
    context: PassContext = field(default_factory=lambda: PassContext())
    optimizer: Optimizer | None = None  # the training step's, to compare with torch.optim
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def graph(self) -> Graph:
        return next(iter(self.program))

    def summary(self) -> dict[str, Any]:
        """The numbers of the report: counts, parameters, estimated FLOPs, pass times, and
        the sharding plan when there is one."""
        graph = self.graph
        plan = self.context.result(ShardingPlans).get(graph.name)
        params = graph.inputs_with_role(Role.PARAM)
        flops = sum(node_flops(n) for g in self.program for n in g.nodes)
        ops = Counter(n.op for g in self.program for n in g.nodes)
        return {
            "model": self.spec.name,
            "source": self.spec.source,
            "mode": self.mode,
            "graphs": len(self.program),
            "nodes": sum(len(g) for g in self.program),
            "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
            "parameters": sum(p.type.numel for p in params),
            "parameter_bytes": sum(p.type.nbytes for p in params),
            "parameter_tensors": len(params),
            "flops_estimated": flops,
            "capture_seconds_measured": round(self.capture_seconds, 4),
            "passes": [
                {"name": r.name, "seconds_measured": round(r.seconds, 4),
                 "nodes_before": r.nodes_before, "nodes_after": r.nodes_after}
                for r in self.pass_manager.records
            ],
            **({"plan": plan_report(graph, plan)} if plan is not None else {}),
            **self.extra,
        }


def plan_report(graph: Graph, plan) -> dict[str, Any]:
    """The sharding plan as report data: estimated times, memory, layouts, solver stats."""
    return {
        "mesh": str(graph.mesh),
        "cluster": graph.mesh.cluster.name if graph.mesh.cluster else None,
        "compute_model": f"roofline, {plan.compute_model}" if plan.compute_model else None,
        "step_seconds_estimated": plan.step_seconds,
        "compute_seconds_estimated": plan.compute_seconds,
        "communication_seconds_estimated": plan.comm_seconds,
        "memory_bytes_per_device_estimated": plan.memory_bytes,
        "reshards": graph.attrs.get("reshards", 0),
        "solver": plan.stats,
        "input_layouts": {v.name: str(v.layout) for v in graph.inputs},
        "node_layouts": [
            {"index": i, "op": n.op, "module": n.module,
             "outputs": [str(o.layout) for o in n.outputs]}
            for i, n in enumerate(graph.nodes)],
    }


def capture(spec: ModelSpec, mode: str = "infer", optimizer: Optimizer | None = None,
            keep_grads: bool = False) -> Captured:
    """`spec`'s inference graph, or its training step; `keep_grads` keeps the gradients as
    outputs beside the optimizer's updates (to compare them with eager).

    A module built on the meta device is captured without weights; its real ones are made
    when the capture's state is first read, to run it (see `ModelSpec.real_module`)."""
    if mode == "infer":
        captured = capture_inference(spec.module, spec.inputs, name=_graph_name(spec.name))
    elif mode == "train":
        if spec.loss_fn is None:
            raise UsageError(f"{spec.source or spec.name}: --mode train needs a loss: define "
                             "`loss(output, *targets)` and `targets()` next to `build()`")
        captured = capture_training(spec.module, spec.inputs, spec.loss_fn, spec.targets,
                                    optimizer=optimizer, name=_graph_name(spec.name) + "_train",
                                    keep_grads=keep_grads)
    else:
        raise UsageError(f"unknown mode {mode!r}; use 'infer' or 'train'")
    if captured.abstract:
        make_state = real_state(captured.graph, captured.state)
        captured.realize = lambda: make_state(spec.real_module())
    return captured


def compile_model(spec: ModelSpec, mode: str = "infer",
                  pipeline: str | Sequence[Any] = DEFAULT_PIPELINE,
                  optimizer: Optimizer | None = None, keep_grads: bool = False,
                  **manager_options: Any) -> CompileResult:
    """Capture `spec` and run `pipeline` over it, verifying between passes. `keep_grads`:
    a training step also returns its gradients (see `capture`)."""
    passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(pipeline)
    start = time.perf_counter()
    captured = capture(spec, mode, optimizer, keep_grads)
    capture_seconds = time.perf_counter() - start
    manager = PassManager(passes, **manager_options)
    # the model's constants (a causal mask kept as a buffer) let passes read masks off them;
    # a capture without weights keeps none (reading its state would make the weights)
    context = PassContext({"constants": {} if captured.abstract else captured.state})
    program = manager.run(captured.graph, context)
    return CompileResult(spec, mode, captured, program, capture_seconds, manager, context,
                         optimizer)


def _graph_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name) or "main"
