"""graphpar.models."""
