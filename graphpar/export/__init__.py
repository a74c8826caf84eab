"""The export wing: a plan handed to PyTorch (a torch program, DTensor placements, torch-mlir)."""
