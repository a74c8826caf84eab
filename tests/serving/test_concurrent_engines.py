"""Engines of different models stepping at the same time in threads of one process (what
`graphpar serve --model a=... --model b=...` does): each keeps its own tokens."""

import threading

import pytest
from serve_testutil import eager_greedy, prompts, run_interleaved

from graphpar.serving.sampling import SamplingParams


@pytest.mark.parametrize("rounds", [3, pytest.param(24, marks=pytest.mark.slow)])
def test_two_engines_stepping_concurrently_give_eager_tokens(rounds, models, engines):
    """Two engines run generate() in two threads, ``rounds`` at once, with the interpreter's
    thread switches made as frequent as Python allows; every round's greedy tokens equal
    eager PyTorch's. Decode and prefill steps of the two models interleave, so per-step state
    shared between them (the paged kernels' step metadata) would mix their block tables."""
    names = ("gpt", "llama")
    batch = prompts([3, 9, 5, 12, 7, 2], seed=11)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = {name: [eager_greedy(models(name), p, 8) for p in batch] for name in names}
    llms = {name: engines(name) for name in names}  # built (captured) before the threads
    got = {name: [] for name in names}
    errors = []
    barrier = threading.Barrier(len(names))

    def serve(name):
        llm = llms[name]
        try:
            for _ in range(rounds):
                barrier.wait(timeout=60)
                outputs = llm.generate(batch, params)
                got[name].append([o.outputs[0].token_ids for o in outputs])
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)
            barrier.abort()

    run_interleaved(serve, [(name,) for name in names], timeout=300)
    assert not errors, errors
    for name in names:
        assert len(got[name]) == rounds
        wrong = [i for i, tokens in enumerate(got[name]) if tokens != expected[name]]
        assert not wrong, f"{name}: rounds {wrong} of {rounds} differ from eager"
