"""The export wing: a plan handed to PyTorch (a torch program, DTensor placements, torch-mlir).

`graphpar.export.apply_plan(module, "DIR/plan.json", device_mesh)` puts a `--to dtensor`
plan onto the user's own module (docs/export.md)."""

from graphpar.export.dtensor_plan import apply_plan, count_collectives

__all__ = ["apply_plan", "count_collectives"]
