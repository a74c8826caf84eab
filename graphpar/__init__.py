"""graphpar: compile an ordinary PyTorch model into a plan that runs on many devices."""

__version__ = "0.1.0"
