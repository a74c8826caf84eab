"""Token-sliced pipeline programs: each token slice's training step cut into the stages of a
whole-sequence pipeline, beside that pipeline's optimizer updates.

A slice's step (`graphpar.capture.token_slice`) is a training graph like the whole sequence's,
with the keys and values of earlier slices as inputs and its grown cache as outputs. It is cut
into stages with the same machinery (`follow_forward`, `split_stages`): its forward nodes take
the stage of the module they belong to in the whole-sequence pipeline (so a layer, its
parameters and its keys and values stay on one stage), the rest follows. The optimizer update
runs once per step on the summed gradients, so it is the whole pipeline's update program U of
each stage, fed by parameter name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphpar.errors import PassError
from graphpar.ir.graph import Graph, Node, OutputRole, Role
from graphpar.ir.pipeline_programs import PipelinePrograms, SlicePrograms, TokenPrograms
from graphpar.passes.pipeline.partition import (
    follow_forward,
    forward_backward_optimizer,
    value_name,
)
from graphpar.passes.pipeline.stage_programs import split_stages

# the types live in graphpar.ir.pipeline_programs; their names stay importable from here
__all__ = ["SlicePrograms", "TokenPrograms", "slice_stage_of", "split_token_slices"]


def slice_stage_of(graph: Graph, whole: Graph, whole_stage_of: Mapping[Node, int]
                   ) -> dict[Node, int]:
    """Every node's stage in a slice step `graph`: a forward node goes to the stage of its
    module in the whole-sequence step `whole` (the earliest, should the module span two), and
    never before what it reads; the rest follows the forward (`follow_forward`)."""
    whole_forward, _, _ = forward_backward_optimizer(whole)
    module_stage: dict[str, int] = {}
    for node in whole.nodes:
        if node in whole_forward and node.module is not None:
            stage = whole_stage_of[node]
            module_stage[node.module] = min(stage, module_stage.get(node.module, stage))
    forward, _, _ = forward_backward_optimizer(graph)
    assign: dict[Node, int] = {}
    for node in graph.nodes:
        if node in forward:
            before = [assign[v.producer] for v in node.input_values if v.producer in assign]
            assign[node] = max([module_stage.get(node.module or "", 0), *before])
    return follow_forward(graph, assign)


def split_token_slices(whole: PipelinePrograms, slice_graphs: Sequence[Graph],
                       token_slices: Sequence[int]) -> TokenPrograms:
    """The stage programs of every slice step (`slice_graphs[j]` for `token_slices[j]`
    tokens), on the stages of the whole-sequence pipeline `whole`.

    `whole` must keep its gradients as outputs (compiled with keep_grads): they tell which
    parameter each update program's gradient input is. PassError otherwise, or when a slice
    step's parameters differ from the whole step's."""
    grad_param = {value_name(whole.graph, o.value): o.target for o in whole.graph.outputs
                  if o.role is OutputRole.GRAD}
    if not grad_param:
        raise PassError(f"graph @{whole.graph.name} has no gradient outputs: token slicing "
                        "feeds its update programs by parameter, so compile the pipeline with "
                        "keep_grads=True")
    params = {v.name for v in whole.graph.inputs_with_role(Role.PARAM)}
    slices, offset = [], 0
    produced: dict[str, set[int]] = {}  # parameter -> stages whose backward makes its gradient
    for graph, length in zip(slice_graphs, token_slices):
        own = {v.name for v in graph.inputs_with_role(Role.PARAM)}
        if own - params:
            raise PassError(f"the slice step @{graph.name} has parameters the whole step lacks: "
                            f"{', '.join(sorted(own - params)[:3])}")
        programs = split_stages(graph, slice_stage_of(graph, whole.graph, whole.stage_of),
                                zero_bubble=False)
        if len(programs.stages) != len(whole.stages):
            raise PassError(f"the slice step @{graph.name} spans {len(programs.stages)} stages, "
                            f"the pipeline {len(whole.stages)}: its modules do not reach every "
                            "stage (is a stage's forward made of ops no module owns?)")
        for stage in programs.stages:
            for out in stage.backward.outputs if stage.backward is not None else ():
                if out.role is OutputRole.GRAD and out.target in params:
                    produced.setdefault(out.target, set()).add(stage.stage)
        slices.append(SlicePrograms(offset, length, programs))
        offset += length
    updated_on = {}
    for stage in whole.stages:
        for v in stage.update.inputs if stage.update is not None else ():
            if v.name in grad_param:
                updated_on[grad_param[v.name]] = stage.stage
    transfers = sorted((src, dst, param) for param, dst in updated_on.items()
                       for src in produced.get(param, ()) if src != dst)
    return TokenPrograms(whole, tuple(slices), grad_param, tuple(transfers))
