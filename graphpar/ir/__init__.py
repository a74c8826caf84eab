"""graphpar.ir."""
