"""`--to mlir`: graphs in torch-mlir's `torch` dialect, one `func.func` each.

Each graph is rebuilt as an fx.GraphModule of ATen ops (`fx_graph.graph_module`) and imported
by torch-mlir's FX importer into one MLIR module. torch-mlir is optional (the `mlir` extra):
without it this raises a UsageError that says how to install it.
"""

from __future__ import annotations

from collections.abc import Mapping

from graphpar.errors import UsageError
from graphpar.export.fx_graph import graph_module
from graphpar.ir.graph import Graph

__all__ = ["mlir_module", "require_torch_mlir"]


def require_torch_mlir():
    try:
        from torch_mlir import ir
        from torch_mlir.dialects import torch as torch_d
        from torch_mlir.extras.fx_importer import FxImporter
    except ImportError:
        raise UsageError("--to mlir needs torch-mlir: pip install 'graphpar[mlir]' (or pip "
                         "install torch-mlir)") from None
    return ir, torch_d, FxImporter


def mlir_module(graphs: Mapping[str, Graph]) -> str:
    """The text of one MLIR module holding `func.func @name` for each named graph, in the
    torch dialect as torch-mlir's FX importer writes it (torch.aten.* ops on
    !torch.vtensor types)."""
    ir, torch_d, FxImporter = require_torch_mlir()
    context = ir.Context()
    torch_d.register_dialect(context)
    importer = FxImporter(context=context)
    for name, graph in graphs.items():
        importer.import_stateless_graph(graph_module(graph).graph, func_name=name)
    importer.module.operation.verify()
    return str(importer.module)
