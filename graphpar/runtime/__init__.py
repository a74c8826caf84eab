"""graphpar.runtime."""
