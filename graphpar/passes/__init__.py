"""Passes over the IR and the pass manager that runs them."""

from graphpar.passes import (  # noqa: F401  (registers the passes)
    autoshard,
    cleanup,
    lower_cuda,
    lower_spmd,
    paged_attention,
)
from graphpar.passes.autoshard import serving  # noqa: F401  (registers shard-serving)
from graphpar.passes.manager import (
    GraphPass,
    Pass,
    PassContext,
    PassManager,
    available_passes,
    make_pass,
    parse_pipeline,
    register_alias,
    register_pass,
    run_pipeline,
)
from graphpar.passes.pipeline import (
    slice_stages,  # noqa: F401  (registers slice-stages)
    slice_tokens,  # noqa: F401  (registers slice-tokens)
)

__all__ = ["GraphPass", "Pass", "PassContext", "PassManager", "available_passes", "make_pass",
           "parse_pipeline", "register_alias", "register_pass", "run_pipeline"]
