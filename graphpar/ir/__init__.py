"""graphpar.ir: the IR; `load_ops` registers its op dialects, once, when the package loads."""

from __future__ import annotations

import importlib

DIALECTS = ("graphpar.ir.ops", "graphpar.ir.spmd_ops", "graphpar.ir.paged_ops")
"""Modules that each declare a list `OPS` of op definitions, registered in this order."""

_loaded = False


def load_ops() -> None:
    """Register every dialect's ops (the first call does it; later calls do nothing)."""
    global _loaded
    if _loaded:
        return
    from graphpar.ir.registry import register

    _loaded = True
    for module in DIALECTS:
        for op in importlib.import_module(module).OPS:
            register(op)


load_ops()

from graphpar.ir import printer  # noqa: E402,F401  (gives graphs their text form, str(graph))
