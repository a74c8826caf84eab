"""The export wing: a plan handed to PyTorch (a torch program, DTensor placements, torch-mlir).

`graphpar.export.apply_plan(module, "DIR/plan.json", device_mesh)` puts a `--to dtensor`
plan onto the user's own module; `apply_pipeline` builds a pipelined plan's stage and
schedule with torch.distributed.pipelining (docs/export.md)."""

from graphpar.export.dtensor_pipeline import apply_pipeline
from graphpar.export.dtensor_plan import apply_plan, count_collectives

__all__ = ["apply_pipeline", "apply_plan", "count_collectives"]
