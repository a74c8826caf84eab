"""`lower-cuda`: device programs to CUDA listings (cuBLAS, NCCL and generated-kernel calls over
a planned memory arena per device); see docs/cuda-backend.md."""

from __future__ import annotations

from dataclasses import dataclass

from graphpar.ir.cuda_listing import Listing
from graphpar.ir.graph import Program
from graphpar.passes.lower_cuda import (  # noqa: F401 (register their ops)
    attention_ops,
    comm_ops,
    compute_ops,
    conv_ops,
    index_ops,
    shape_ops,
)
from graphpar.passes.lower_cuda.lowering import UnsupportedLowering, lower_to_listing
from graphpar.passes.manager import Pass, PassContext, register_pass

__all__ = ["CudaListings", "LowerCuda", "UnsupportedLowering", "lower_to_listing"]


class CudaListings(dict):
    """lower-cuda's result: graph name -> one listing per device, in rank order."""


@register_pass("lower-cuda")
@dataclass
class LowerCuda(Pass):
    """Lower every device program to a listing per device; the IR is left as it is.

    memory_limit: bytes a device's arena may use (0: no limit); a plan above it is an error
    that says by how much and which tensors are live at the peak."""

    memory_limit: int = 0

    def run(self, program: Program, ctx: PassContext) -> bool:
        listings = ctx.result(CudaListings)
        for graph in program:
            ranks = range(graph.mesh.size) if graph.mesh is not None else range(1)
            listings[graph.name] = [lower_to_listing(graph, graph.mesh, r, self.memory_limit)
                                    for r in ranks]
        return False


def listings_of(ctx: PassContext) -> dict[str, list[Listing]]:
    """The listings lower-cuda left in `ctx`, by graph name."""
    return dict(ctx.result(CudaListings))
