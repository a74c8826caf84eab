"""Paged attention in a listing: `paged.reshape_and_cache` writes the caches in place in the
state region and `paged.attention` reads them through block tables (the existing kernels on a
GPU, the pure-torch reference on the CPU): equal to the interpreter for decode and prefill."""

from __future__ import annotations

import pytest
import torch

from graphpar.backends.cuda.cpu_executor import CpuListingExecutor
from graphpar.backends.interpreter import Interpreter
from graphpar.ir.graph import Graph, OutputRole, Role
from graphpar.ir.types import TensorType
from graphpar.passes.lower_cuda import lower_to_listing

F32, I32 = torch.float32, torch.int32
BLOCKS, BLOCK, KV, HEADS, D = 6, 4, 2, 4, 16


def _graph(mode: str, tokens: int, seqs: int) -> Graph:
    g = Graph("step")
    q = g.add_input("q", TensorType((tokens, HEADS, D), F32))
    k = g.add_input("k", TensorType((tokens, KV, D), F32))
    v = g.add_input("v", TensorType((tokens, KV, D), F32))
    slots = g.add_input("slots", TensorType((tokens,), torch.int64))
    kc = g.add_input("key_cache", TensorType((BLOCKS, BLOCK, KV, D), F32), Role.BUFFER)
    vc = g.add_input("value_cache", TensorType((BLOCKS, BLOCK, KV, D), F32), Role.BUFFER)
    tables = g.add_input("tables", TensorType((seqs, 3), I32))
    lens = g.add_input("lens", TensorType((seqs,), I32))
    extra = [g.add_input("starts", TensorType((seqs + 1,), I32))] if mode == "prefill" else []
    cached = g.create("reshape_and_cache", [kc, vc, k, v, slots], {"kernel": "reference"})
    out = g.create("paged_attention", [q, *cached.outputs, tables, lens, *extra],
                   {"scale": 0.25, "mode": mode, "kernel": "reference"})
    g.add_output(out.output)
    g.add_output(cached.outputs[0], OutputRole.UPDATE, "key_cache")
    g.add_output(cached.outputs[1], OutputRole.UPDATE, "value_cache")
    return g


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_paged_calls_equal_the_interpreter(mode):
    gen = torch.Generator().manual_seed(0)
    if mode == "decode":  # two sequences of 5 and 9 tokens, one new token each
        tokens, lens, slots, starts = 2, [5, 9], [4, 12 + 8], None
    else:  # one sequence prefilling its 6 tokens
        tokens, lens, slots, starts = 6, [6], list(range(6)), [0, 6]
    graph = _graph(mode, tokens, len(lens))
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]][:len(lens)], dtype=I32)
    inputs = {
        "q": torch.randn(tokens, HEADS, D, generator=gen),
        "k": torch.randn(tokens, KV, D, generator=gen),
        "v": torch.randn(tokens, KV, D, generator=gen),
        "slots": torch.tensor(slots),
        "key_cache": torch.randn(BLOCKS, BLOCK, KV, D, generator=gen),
        "value_cache": torch.randn(BLOCKS, BLOCK, KV, D, generator=gen),
        "tables": tables, "lens": torch.tensor(lens, dtype=I32),
    }
    if starts is not None:
        inputs["starts"] = torch.tensor(starts, dtype=I32)
    listing = lower_to_listing(graph)
    assert [c.kind for c in listing.calls] == ["paged.reshape_and_cache", "paged.attention"]
    # the caches are updated where they live: their outputs are the state inputs' addresses
    by_name = {r.name: r.addr for r in listing.inputs}
    assert [o.addr for o in listing.outputs[1:]] == [by_name["key_cache"],
                                                      by_name["value_cache"]]
    expected = Interpreter(graph).run({k: t.clone() for k, t in inputs.items()})
    got = CpuListingExecutor(listing, poison=True).run(inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
