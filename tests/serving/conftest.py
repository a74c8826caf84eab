"""Shared fixtures of the serving tests: tiny models, and engines built once per session."""

import pytest
import torch
from serve_testutil import MODELS


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and spinning threads slow a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def models():
    """One module per name, shared so that engines over it capture its graphs once."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = MODELS[name]()
        return cache[name]
    return get


@pytest.fixture(scope="session")
def engines(models):
    """An LLM per model name (4 sequences per step, 8-token blocks), built once."""
    from graphpar.serving.llm import LLM

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = LLM(models(name), max_num_seqs=4, block_size=8, num_blocks=64)
        return cache[name]
    return get


