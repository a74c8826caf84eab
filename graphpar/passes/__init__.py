"""graphpar.passes."""
