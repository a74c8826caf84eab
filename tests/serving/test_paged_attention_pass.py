"""The paged-attention pass: prefill and decode graphs over a paged KV cache equal the contiguous
graphs they come from (MHA, GQA, MQA; head sizes 64-256; fp32/fp16/bf16)."""

import pytest
import torch

import graphpar.passes.paged_attention  # noqa: F401  (registers the pass)
from graphpar.backends import reference
from graphpar.backends.interpreter import Interpreter
from graphpar.capture.decoder import (
    KVState,
    capture_decode,
    capture_prefill,
    decoder_adapter,
    kv_cache_attention,
)
from graphpar.errors import GenerationError, PassError
from graphpar.ir import paged_reference as reference_paged
from graphpar.ir.graph import OutputRole
from graphpar.ir.parser import parse
from graphpar.ir.printer import print_graph
from graphpar.ir.verify import verify
from graphpar.models import get_model
from graphpar.passes import available_passes, run_pipeline

BLOCK = 4
NUM_BLOCKS = 24


def llama(kv_heads, heads=4, head_size=8, layers=1, dtype=None):
    return get_model("llama", "tiny", n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                     d_model=heads * head_size, ffn_dim=32, vocab_size=64, seq_len=32,
                     dtype=dtype).module


def paged(graph, **options):
    graph = graph.copy()
    opts = ",".join(f"{k}={v}" for k, v in {"block_size": BLOCK, "num_blocks": NUM_BLOCKS,
                                            **options}.items())
    run_pipeline(graph, f"paged-attention{{{opts}}},cleanup")
    return graph


def caches(graph, info_from):
    """Random (finite) caches for every key_cache.i / value_cache.i input of the graph."""
    out = {}
    for v in graph.inputs:
        if v.name.startswith(("key_cache.", "value_cache.")):
            out[v.name] = torch.randn(v.type.shape).to(v.type.dtype)
    return out


def test_pass_is_registered():
    assert "paged-attention" in available_passes()


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_prefill_two_sequences_through_shuffled_blocks(kv_heads):
    module = llama(kv_heads)
    captured = capture_prefill(module, num_tokens=9, num_logits=2)
    graph = paged(captured.graph)
    verify(graph)
    assert parse(print_graph(graph)) == graph
    assert not graph.find("attention")
    assert [n.attrs["mode"] for n in graph.find("paged_attention")] == ["prefill"]
    kinds = [(o.role, o.target) for o in graph.outputs]
    assert kinds == [(OutputRole.OUTPUT, None), (OutputRole.UPDATE, "key_cache.0"),
                     (OutputRole.UPDATE, "value_cache.0")]
    # Sequence A: tokens 0-3 in block 7; sequence B: tokens 0-4 in blocks 2, 11.
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    inputs = dict(captured.state, **caches(graph, module))
    inputs.update(input_ids=ids, positions=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]),
                  logits_indices=torch.tensor([3, 8]),
                  slot_mapping=torch.tensor([28, 29, 30, 31, 8, 9, 10, 11, 44]),
                  block_tables=torch.tensor([[7] + [0] * 7, [2, 11] + [0] * 6],
                                            dtype=torch.int32),
                  context_lens=torch.tensor([4, 5], dtype=torch.int32),
                  query_start_loc=torch.tensor([0, 4, 9], dtype=torch.int32))
    (logits, key_cache, _) = reference.run(graph, inputs)
    with torch.no_grad():
        torch.testing.assert_close(logits[0, 0], module(ids[:, :4])[0, -1], atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(logits[0, 1], module(ids[:, 4:])[0, -1], atol=1e-5,
                                   rtol=1e-5)
    # The prompt's keys are in the cache, where the slot mapping says.
    adapter, state = decoder_adapter(module), KVState()
    with torch.no_grad(), kv_cache_attention(state, adapter):
        adapter(ids[:, :4], torch.arange(4)[None])
    torch.testing.assert_close(key_cache[7], state.present[0][0][0].transpose(0, 1))
    # The engine's compiled form of the graph computes the same (it writes the caches again).
    (again, *_) = Interpreter(graph, checked=(), inference=True).run(inputs)
    torch.testing.assert_close(again, logits)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_decode_equals_contiguous_decode(kv_heads):
    """Two sequences (contexts 5 and 3) decode one token through their block tables; the
    contiguous decode graph on the same K/V (left-padded, masked) gives the same logits."""
    module = llama(kv_heads, layers=2)
    captured = capture_decode(module, batch=2, past_len=4)
    graph = paged(captured.graph)
    verify(graph)
    assert parse(print_graph(graph)) == graph
    assert [n.attrs["mode"] for n in graph.find("paged_attention")] == ["decode", "decode"]
    names = {v.name for v in graph.inputs}
    assert not any(n.startswith(("past_", "attn_mask")) for n in names)
    assert {"slot_mapping", "block_tables", "context_lens"} <= names
    generator = torch.Generator().manual_seed(1)
    info_heads = kv_heads
    past = [torch.randn(2, info_heads, 4, 8, generator=generator) for _ in range(4)]
    mask = torch.tensor([[True, True, True, True, True], [False, False, True, True, True]])
    ids = torch.tensor([[3], [9]])
    positions = torch.tensor([[4], [2]])
    names = [f"past_{kind}.{i}" for i in range(2) for kind in ("key", "value")]
    expected = reference.run(captured.graph, {**captured.state, **dict(zip(names, past)),
                                              "input_ids": ids, "positions": positions,
                                              "attn_mask": mask})[0]
    # The same K/V in shuffled blocks: sequence 0 in blocks 5, 1; sequence 1 in block 20.
    tables = torch.tensor([[5, 1] + [0] * 6, [20] + [0] * 7], dtype=torch.int32)
    inputs = dict(captured.state, **caches(graph, module))
    for layer in range(2):
        k_cache, v_cache = inputs[f"key_cache.{layer}"], inputs[f"value_cache.{layer}"]
        for row, (length, table) in enumerate([(4, [5, 1]), (2, [20])]):
            slots = [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(length)]
            k = past[2 * layer][row, :, 4 - length:].transpose(0, 1)
            v = past[2 * layer + 1][row, :, 4 - length:].transpose(0, 1)
            reference_paged.reshape_and_cache(k, v, k_cache, v_cache, torch.tensor(slots))
    inputs.update(input_ids=ids, positions=positions,
                  slot_mapping=torch.tensor([1 * BLOCK + 0, 20 * BLOCK + 2]),
                  block_tables=tables, context_lens=torch.tensor([5, 3], dtype=torch.int32))
    got = reference.run(graph, inputs)[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_head_sizes_of_the_cuda_kernels(head_size):
    module = llama(1, heads=2, head_size=head_size)
    captured = capture_prefill(module, num_tokens=3, num_logits=1)
    graph = paged(captured.graph, kernel="cuda")  # accepted: the kernels have this head size
    verify(graph)
    graph = paged(captured.graph)  # run it on the CPU path
    ids = torch.tensor([[1, 2, 3]])
    inputs = dict(captured.state, **caches(graph, module))
    inputs.update(input_ids=ids, positions=torch.arange(3)[None],
                  logits_indices=torch.tensor([2]), slot_mapping=torch.tensor([0, 1, 2]),
                  block_tables=torch.zeros(1, 8, dtype=torch.int32),
                  context_lens=torch.tensor([3], dtype=torch.int32),
                  query_start_loc=torch.tensor([0, 3], dtype=torch.int32))
    with torch.no_grad():
        torch.testing.assert_close(reference.run(graph, inputs)[0][0, 0], module(ids)[0, -1],
                                   atol=1e-4, rtol=1e-4)


def test_unsupported_head_size_for_cuda_is_a_generation_error():
    captured = capture_prefill(llama(2), num_tokens=3, num_logits=1)  # head size 8
    with pytest.raises(GenerationError, match="head size 8 is not supported.*64, 80, 96, 128, "
                                              "256"):
        paged(captured.graph, kernel="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    module = llama(2, layers=1, dtype=dtype)
    captured = capture_prefill(module, num_tokens=5, num_logits=1)
    graph = paged(captured.graph)
    cache_types = {v.type.dtype for v in graph.inputs if v.name.startswith("key_cache")}
    assert cache_types == {dtype}
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    inputs = dict(captured.state, **caches(graph, module))
    inputs.update(input_ids=ids, positions=torch.arange(5)[None],
                  logits_indices=torch.tensor([4]), slot_mapping=torch.arange(5) + 8,
                  block_tables=torch.tensor([[2, 3] + [0] * 6], dtype=torch.int32),
                  context_lens=torch.tensor([5], dtype=torch.int32),
                  query_start_loc=torch.tensor([0, 5], dtype=torch.int32))
    got = reference.run(graph, inputs)[0][0, 0].float()
    expected = captured.run(ids, torch.arange(5)[None], torch.tensor([4]))[0][0, 0].float()
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


def test_non_causal_attention_cannot_be_paged():
    from graphpar.capture import capture_inference

    class Bidirectional(torch.nn.Module):
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    graph = capture_inference(Bidirectional(), (torch.randn(1, 2, 4, 8),)).graph
    with pytest.raises(PassError, match="not causal"):
        paged(graph, max_blocks_per_seq=4)


def test_plain_causal_capture_is_paged_too():
    """A model captured with capture_inference (no explicit cache) pages the same way: each
    batch row is one sequence."""
    from graphpar.capture import capture_inference

    module = llama(2)
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(3))
    captured = capture_inference(module, (ids,))
    graph = paged(captured.graph, max_blocks_per_seq=2)
    inputs = dict(captured.state, **caches(graph, module))
    inputs.update(idx=ids, slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
                  block_tables=torch.tensor([[0, 0], [1, 0]], dtype=torch.int32),
                  context_lens=torch.tensor([4, 4], dtype=torch.int32),
                  query_start_loc=torch.tensor([0, 4, 8], dtype=torch.int32))
    with torch.no_grad():
        torch.testing.assert_close(reference.run(graph, inputs)[0], module(ids), atol=1e-5,
                                   rtol=1e-5)


class MaskedSelfAttention(torch.nn.Module):
    """Self-attention over 2 heads with its causal mask built from positions, as Hugging Face
    builds it (kv_idx <= q_idx, and kv_idx > q_idx - window for a sliding window)."""

    def __init__(self, window=None):
        super().__init__()
        self.window = window
        self.embed = torch.nn.Embedding(64, 16)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, ids):
        b, s = ids.shape
        q, k, v = self.qkv(self.embed(ids)).reshape(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        at, key = torch.arange(s)[:, None], torch.arange(s)[None, :]
        mask = key <= at
        if self.window:
            mask = mask & (key > at - self.window)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_causal_mask_built_from_positions_is_paged_as_causal():
    from graphpar.capture import capture_inference

    module = MaskedSelfAttention()
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(3))
    captured = capture_inference(module, (ids,))
    (node,) = captured.graph.find("attention")
    assert not node.attrs["causal"] and len(node.inputs) == 4  # causal by its mask alone
    graph = paged(captured.graph, max_blocks_per_seq=2)
    assert not graph.find("le") and not graph.find("arange")  # the mask went with it
    inputs = dict(captured.state, **caches(graph, module))
    inputs.update(ids=ids, slot_mapping=torch.arange(8),
                  block_tables=torch.tensor([[0, 0], [1, 0]], dtype=torch.int32),
                  context_lens=torch.tensor([4, 4], dtype=torch.int32),
                  query_start_loc=torch.tensor([0, 4, 8], dtype=torch.int32))
    with torch.no_grad():
        torch.testing.assert_close(reference.run(graph, inputs)[0], module(ids), atol=1e-5,
                                   rtol=1e-5)
    windowed = capture_inference(MaskedSelfAttention(window=2), (ids,)).graph
    with pytest.raises(PassError, match="attention is causal with a sliding window of 2 keys; "
                                        "only plain causal self-attention"):
        paged(windowed, max_blocks_per_seq=2)
