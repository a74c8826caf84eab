"""Runtime pieces under the engine: shape templates, the compiled executor, the batched torch
paged-attention path against the reference."""

import pytest
import torch

import graphpar.passes.paged_attention  # noqa: F401
from graphpar.backends import reference, torch_paged
from graphpar.backends.interpreter import Interpreter
from graphpar.capture.decoder import capture_prefill
from graphpar.ir import paged_reference as reference_paged
from graphpar.ir.graph_template import GraphTemplate, TemplateError
from graphpar.passes import run_pipeline
from graphpar.serving.paged_model import bucket

PIPELINE = "paged-attention{block_size=8,num_blocks=16},cleanup"


def paged_prefill(module, tokens, seqs):
    graph = capture_prefill(module, tokens, seqs).graph
    run_pipeline(graph, PIPELINE)
    return graph


def test_template_specializes_like_a_fresh_capture(models):
    module = models("llama")
    base, more_t, more_n = (paged_prefill(module, t, n) for t, n in ((6, 2), (7, 2), (6, 3)))
    template = GraphTemplate.fit(base, {"T": 6, "N": 2}, {"T": (7, more_t), "N": (3, more_n)})
    assert template.num_varying > 0
    fresh = paged_prefill(module, 11, 4)
    assert template.specialize(T=11, N=4) == fresh
    assert template.specialize(T=11, N=4) is template.specialize(T=11, N=4)  # cached


def test_template_rejects_different_programs(models):
    module = models("gpt")
    base = paged_prefill(module, 6, 2)
    other = capture_prefill(module, 7, 2).graph  # not paged: another program
    with pytest.raises(TemplateError, match="different program"):
        GraphTemplate.fit(base, {"T": 6}, {"T": (7, other)})


def test_compiled_graph_equals_reference_executor(models):
    module = models("gpt")
    captured = capture_prefill(module, 5, 1)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    args = captured.bind(ids, torch.arange(5)[None], torch.tensor([4]))
    expected = reference.run(captured.graph, args)
    got = Interpreter(captured.graph, checked=(), inference=True).run(args)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 16, 17, 40)] == [1, 2, 4, 8, 16, 16, 32, 48]


def _batch(kv_heads, dtype, head_size=16, heads=4):
    generator = torch.Generator().manual_seed(0)
    shape = (32, 8, kv_heads, head_size)
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.randperm(32, generator=generator)[:24].view(4, 6).int()
    return k, v, tables, heads


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_path_equals_reference(kv_heads, dtype):
    k, v, tables, heads = _batch(kv_heads, dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2,
                                                                         "rtol": 1e-2}
    query = torch.randn(4, heads, 16).to(dtype)
    lens = torch.tensor([1, 8, 0, 45], dtype=torch.int32)  # one empty sequence
    torch.testing.assert_close(torch_paged.paged_attention(query, k, v, tables, lens, 0.3),
                               reference_paged.paged_attention(query, k, v, tables, lens, 0.3),
                               **tol)
    # Prefill: 3 new tokens after 9 cached, none, 1 new (a decode), 5 new of a fresh prompt.
    starts = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    lens = torch.tensor([12, 7, 20, 5], dtype=torch.int32)
    query = torch.randn(9, heads, 16).to(dtype)
    torch.testing.assert_close(
        torch_paged.paged_prefill_attention(query, k, v, tables, lens, starts, 0.3),
        reference_paged.paged_prefill_attention(query, k, v, tables, lens, starts, 0.3), **tol)


def test_torch_cache_write_skips_padding():
    k, v, _, _ = _batch(2, torch.float32)
    k2, v2 = k.clone(), v.clone()
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, -1, 70])
    torch_paged.reshape_and_cache(key, value, k, v, slots)
    reference_paged.reshape_and_cache(key, value, k2, v2, slots)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_torch_paged_attention_from_two_threads_at_once():
    """Two threads (two engines' loops) call the decode and prefill kernels at once, each with
    its own block tables, new tensors every step and two layers per step, as an engine does;
    every result equals the reference. The kernels build a step's metadata once and reuse it
    for the step's other layers: metadata shared between threads handed one thread's layers
    the other's tables now and then."""
    import threading

    from serve_testutil import run_interleaved

    k, v, tables, heads = _batch(2, torch.float32)
    cases = []
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(32, generator=generator)[:24].view(4, 6).int()
        lens = torch.randint(1, 48, (4,), generator=generator, dtype=torch.int32)
        query = torch.randn(4, heads, 16, generator=generator)
        starts = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
        cases.append((order, lens, query, starts,
                      reference_paged.paged_attention(query, k, v, order, lens, 0.3),
                      reference_paged.paged_prefill_attention(query, k, v, order, lens,
                                                              starts, 0.3)))
    wrong = [0, 0]
    barrier = threading.Barrier(2)

    def steps(i):
        order, lens, query, starts, decode, prefill = cases[i]
        barrier.wait(timeout=30)
        for _ in range(400):
            step_tables, step_lens, step_starts = order.clone(), lens.clone(), starts.clone()
            for _layer in range(2):
                out = torch_paged.paged_attention(query, k, v, step_tables, step_lens, 0.3)
                wrong[i] += not torch.allclose(out, decode, atol=1e-5, rtol=1e-5)
                out = torch_paged.paged_prefill_attention(query, k, v, step_tables, step_lens,
                                                          step_starts, 0.3)
                wrong[i] += not torch.allclose(out, prefill, atol=1e-5, rtol=1e-5)

    run_interleaved(steps, [(0,), (1,)], timeout=120)
    assert wrong == [0, 0]
