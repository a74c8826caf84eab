"""Fixtures shared across the suite."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"


@pytest.fixture
def load_bench():
    """`load_bench("capture")`: the script tools/bench/capture.py as a module, to call its
    `main` and helpers in the test's process."""
    loaded = []

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the body runs
        loaded.append(spec.name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)


@pytest.fixture
def ilp_limits(monkeypatch):
    """What every ILP of a compile was solved under, recorded at the ILP's entry points:
    `["plans"]` (mesh shape, `PlanLimits`) of each `ilp.solve`, the recipe auto-shard and
    every stage's re-solve on its sub-mesh go through; `["layers"]` (memory bytes, seconds)
    of each other `Reduced.solve`, the stage search's per-layer solves."""
    from graphpar.passes.autoshard import ilp
    from graphpar.passes.pipeline import slice_stages

    seen = {"plans": [], "layers": []}
    inside = []
    real_solve, real_reduced_solve = ilp.solve, ilp.Reduced.solve

    def solve(graph, mesh, roofline, limits=ilp.NO_MEMORY_LIMIT, **kwargs):
        seen["plans"].append((tuple(mesh.shape), limits))
        inside.append(graph)
        try:
            return real_solve(graph, mesh, roofline, limits, **kwargs)
        finally:
            inside.pop()

    def reduced_solve(self, memory_limit=None, time_limit=30.0, *args, **kwargs):
        if not inside:
            seen["layers"].append((memory_limit, time_limit))
        return real_reduced_solve(self, memory_limit, time_limit, *args, **kwargs)

    monkeypatch.setattr(ilp, "solve", solve)
    monkeypatch.setattr(ilp.Reduced, "solve", reduced_solve)
    # the stage search's layer solves run in this process, where `seen` is recorded (in
    # forked workers they would record into their copies)
    monkeypatch.setattr(slice_stages, "available_workers", lambda: 1)
    return seen
