"""The certificate: every plan run on CPU ranks against eager PyTorch, element by element
against the rounding its own computation allows, with a verdict and, when it fails, the first
IR node where the plan differs (`eager`, `rounding`, `localize`)."""
