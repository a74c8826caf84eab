"""graphpar.backends.cuda."""
