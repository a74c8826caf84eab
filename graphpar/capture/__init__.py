"""graphpar.capture."""
