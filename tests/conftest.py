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
