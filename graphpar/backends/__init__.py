"""graphpar.backends."""
